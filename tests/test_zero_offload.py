"""ZeRO-Offload at stages 1-2 (the optimizer state of each bucket in a unit store,
stepped bucket by bucket after the reduction; the masters in memory): 10 clipped steps of
the project's GPT give parameters torch.equal to the same stage in memory, at dp=2 in
fp32 and bf16, at tp=2 and at pp=2; so does ZeRO-3 offload (whole units in the store) at
tp=2 (fp32, bf16) and pp=2 (with a head tied to the embedding across the stages too); an
offloaded ZeRO-1 checkpoint resumes in memory."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ranks(require_pycomm, tmp_path_factory):
    from _zero_offload_scenarios import run_all

    from pycomm.testing import run_ranks

    return run_ranks(run_all, 2, str(tmp_path_factory.mktemp("zero-offload")),
                     timeout_s=600.0)


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero2-bf16", "zero1-tp2", "zero1-pp2",
                                  "zero3-tp2", "zero3-tp2-bf16", "zero3-tp2-meta", "zero3-pp2",
                                  "zero3-pp2-tied", "zero3-pp2-tied-unclipped"])
def test_state_offloaded_equals_in_memory(ranks, case):
    """Every step clipped: at tp=2 the norm counts a parameter replicated over tp once
    (a wrong weight changes the clipping coefficient, and with it the parameters)."""
    from _offload_scenarios import CLIP
    from _zero_offload_scenarios import STEPS

    for rank, result in enumerate(ranks):
        want, got = result[(case, "none")], result[(case, "disk")]
        assert want["steps"] is None and got["buckets"] >= 1
        assert got["steps"] == STEPS * got["buckets"]  # every bucket stepped from its record
        assert len(want["params"]) > 0
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"rank {rank} {case}: {name}"
        assert all(norm > CLIP for _, norm in want["curve"])  # (clipped where asked)
        for (loss, norm), (ref_loss, ref_norm) in zip(got["curve"], want["curve"], strict=True):
            assert loss == ref_loss and norm == pytest.approx(ref_norm, rel=1e-12)


def test_an_offloaded_zero1_checkpoint_resumes_in_memory(ranks):
    for result in ranks:
        want = result[("zero1", "none")]["params"]
        for name, value in want.items():
            assert torch.equal(result["resumed"]["params"][name], value), name


def test_the_optimizer_level_checkpoints_refuse_state_in_a_store(require_pycomm, tmp_path):
    """ZeroOptimizer.state_dict and save_sharded read state in memory: with the state
    offloaded they refuse by name rather than save empty tensors."""
    from _zero_offload_scenarios import refused_saves

    from pycomm.testing import run_ranks

    for message in run_ranks(refused_saves, 2, str(tmp_path), timeout_s=300.0)[0]:
        assert "the optimizer state is in the unit store" in message, message
