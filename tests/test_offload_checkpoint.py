"""Checkpoints of offloaded runs (pycomm.parallel.checkpointing.parallel_model through the unit
store): a bf16, clipped run of the tiny Llama saved after 3 of 6 steps offloaded (to files or
host memory) or in memory, and resumed either way, ends with parameters torch.equal to
the run never stopped; an offloaded checkpoint resumes at dp=1 alike offloaded and in
memory; one chunk per file (streamed); and an offloaded fp32 run's HuggingFace export
loads with from_pretrained, its logits equal to the engine's."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def saved(require_pycomm, tmp_path_factory):
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    from _offload_ckpt_scenarios import resumed_alone, run_all

    from pycomm.testing import run_ranks

    root = str(tmp_path_factory.mktemp("offload-ckpt"))
    both = run_ranks(run_all, 2, root, timeout_s=600.0)
    alone = run_ranks(resumed_alone, 1, root, timeout_s=600.0)[0]
    return both, alone


def test_resumed_either_way_equals_the_run_never_stopped(saved):
    from _offload_ckpt_scenarios import RESUMES

    both, _ = saved
    for rank, result in enumerate(both):
        for key in RESUMES:
            for name, value in result["whole"].items():
                assert torch.equal(result[key][name], value), f"rank {rank} {key}: {name}"


def test_a_dp2_offloaded_checkpoint_resumes_at_dp1_offloaded_or_not(saved):
    _, alone = saved
    assert alone["none"].keys() == alone["disk"].keys()
    for name, value in alone["none"].items():
        assert torch.equal(alone["disk"][name], value), name


def test_an_offloaded_checkpoint_streams_one_chunk_per_file(saved):
    both, _ = saved
    assert both[0]["files"] > 20  # every chunk its own file, not one file per rank


def test_hf_export_of_an_offloaded_run_loads_with_equal_logits(require_pycomm, tmp_path):
    transformers = pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    from _offload_ckpt_scenarios import exported

    from pycomm.testing import run_ranks

    result = run_ranks(exported, 2, str(tmp_path), timeout_s=600.0)[0]
    assert "model.safetensors.index.json" in result["files"]  # sharded, streamed
    model = transformers.AutoModelForCausalLM.from_pretrained(result["folder"])
    with torch.no_grad():
        logits = model(result["tokens"]).logits
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)
