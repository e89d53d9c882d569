"""ZeRO-3 offload (pycomm.parallel.zero.offload): 10 steps of the project's GPT and of a tiny
HuggingFace Llama at dp=2 give bit-identical parameters offloaded to files, offloaded to
host memory and in memory (and with activation checkpointing, 4 steps); the records held
do not grow with the depth; what offload cannot run with is refused by name."""

from __future__ import annotations

import pytest
import torch
from _offload_scenarios import CLIP, STEPS

MODELS = ["gpt", "llama"]
KINDS = ["disk", "cpu"]


@pytest.fixture(scope="module")
def ranks(require_pycomm, tmp_path_factory):
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    from _offload_scenarios import run_all

    from pycomm.testing import run_ranks

    return run_ranks(run_all, 2, str(tmp_path_factory.mktemp("offload")), timeout_s=600.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_parameters_bit_identical_to_in_memory_zero3(ranks, model, kind):
    for rank, result in enumerate(ranks):
        want, got = result[(model, "none")], result[(model, kind)]
        assert sorted(got["params"]) == sorted(want["params"])
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"rank {rank}: {name} differs"
        assert [loss for loss, _ in got["curve"]] == [loss for loss, _ in want["curve"]]
        for (_, norm), (_, ref) in zip(got["curve"], want["curve"], strict=True):
            assert norm == pytest.approx(ref, rel=1e-12)  # reported only: summed per unit
        assert len(want["params"]) > 0 and want["stats"] == {}


@pytest.mark.parametrize("model", MODELS)
def test_clipping_with_offload_steps_after_the_norm_bit_identical(ranks, model):
    """max_grad_norm with offload: backward keeps each unit's gradient in its record and
    the units step once the global norm is known, scaled by the same coefficient as in
    memory: the same parameters, every step clipped."""
    _assert_identical(ranks, (model, "clip none"), (model, "clip disk"))


def test_tiles_with_offload_bit_identical(ranks):
    """The Llama's embedding and head as 4 tiles each (``max_unit_bytes``), bf16 and
    clipped: each tile a unit with its own record, the same parameters as in memory."""
    _assert_identical(ranks, ("llama", "tiles none"), ("llama", "tiles disk"))
    for result in ranks:
        assert result[("llama", "tiles disk")]["units"] == result[("llama", "clip disk")][
            "units"] + 8  # the embedding and the head: 4 units each, out of the model's


def test_micro_batches_accumulate_in_the_records_bit_identical(ranks):
    """microbatches=2 with offload (and clipping): each backward sums the unit's reduced
    gradient into its record, the units step after the last, as in memory."""
    _assert_identical(ranks, ("gpt", "accumulate none"), ("gpt", "accumulate disk"))


def _assert_identical(ranks: list, reference: tuple, offloaded: tuple) -> None:
    """Every rank's parameters equal after the steps, every step clipped, the losses
    equal, every unit stepped once a step from its record."""
    for rank, result in enumerate(ranks):
        want, got = result[reference], result[offloaded]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"rank {rank}: {name} differs"
        assert all(norm > CLIP for _, norm in want["curve"]), want["curve"]
        for (loss, norm), (ref_loss, ref_norm) in zip(got["curve"], want["curve"], strict=True):
            assert loss == ref_loss and norm == pytest.approx(ref_norm, rel=1e-12)
        assert got["stats"]["steps"] == STEPS * got["units"]


@pytest.mark.parametrize("model", MODELS)
def test_bf16_offload_bit_identical_to_in_memory_bf16(ranks, model):
    """bf16 compute: each gather casts the fp32 master read from the record, the reduced
    (fp32) gradient steps it: the same parameters and losses as in-memory bf16 ZeRO-3."""
    for rank, result in enumerate(ranks):
        want, got = result[(model, "bf16 none")], result[(model, "bf16 disk")]
        for name, value in want["params"].items():
            assert value.dtype == torch.float32
            assert torch.equal(got["params"][name], value), f"rank {rank}: {name} differs"
        assert [loss for loss, _ in got["curve"]] == [loss for loss, _ in want["curve"]]


def test_fp16_offload_skips_overflowed_steps_as_in_memory(ranks):
    """fp16 with loss scaling: the first steps overflow (the records' gradients are
    dropped, nothing steps), the later ones unscale and clip before stepping: the same
    parameters as in memory."""
    for result in ranks:
        want, got = result[("gpt", "fp16 none")], result[("gpt", "fp16 disk")]
        assert got["skipped"] == want["skipped"] > 0
        assert got["stats"]["steps"] == (STEPS - got["skipped"]) * got["units"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name


def test_live_budget_holds_back_prefetch_and_frees_buffers(ranks):
    """max_live_bytes: units are gathered ahead only within the budget, buffers beyond it
    are freed between uses; the large layers are units of their own; the parameters equal
    bf16 without a budget."""
    from _offload_scenarios import LIVE_BUDGET_BYTES

    for result in ranks:
        free, held = result[("llama", "bf16 disk")], result["budget"]
        assert held["units"] == free["units"] + 2  # embedding and head
        assert held["gathers"]["held_back"] > 0 and free["gathers"]["held_back"] == 0
        assert held["pool"]["reserved_bytes"] <= LIVE_BUDGET_BYTES
        assert held["pool"]["peak_bytes"] < free["pool"]["peak_bytes"]
        assert held["pool"]["buffers"] > free["pool"]["buffers"]  # made again after freeing
        want = result[("llama", "bf16 none")]["params"]
        for name, value in want.items():
            assert torch.equal(held["params"][name], value), name


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adagrad", "adam-amsgrad"])
def test_other_optimizers_keep_their_state_in_the_records(ranks, optimizer):
    """Any per-element optimizer: its state tensors are the records' fields; clipped,
    the parameters equal in-memory ZeRO-3 with the same optimizer."""
    for result in ranks:
        want, got = result[(optimizer, "none")], result[(optimizer, "disk")]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
        assert got["stats"]["steps"] == 4 * got["units"]


def test_recompute_with_offload_bit_identical(ranks):
    for result in ranks:
        want, got = result[("recompute", "none")], result[("recompute", "disk")]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
        assert got["stats"]["steps"] == 4 * got["units"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_every_unit_steps_from_its_record(ranks, model, kind):
    result = ranks[0][(model, kind)]
    stats = result["stats"]
    assert result["units"] >= 3  # the model's own unit and one per block
    assert stats["steps"] == STEPS * result["units"]
    assert stats["bytes_read"] > stats["bytes_written"] > 0  # forward reads masters too
    assert result["files"] == []  # disk: each rank's file is unlinked once open


def test_records_held_do_not_grow_with_depth(ranks):
    shallow, deep = ranks[0][("gpt", "disk")], ranks[0]["deep"]
    assert deep["units"] == shallow["units"] + 4
    assert deep["stats"]["max_records"] == shallow["stats"]["max_records"] <= 6


def test_refuses_what_it_cannot_run(require_pycomm, tmp_path):
    from _offload_scenarios import refused

    from pycomm.testing import run_ranks

    messages = run_ranks(refused, 2, str(tmp_path), timeout_s=300.0)[0]
    named = ["zero=0", "optimizer=LBFGS", "offload_dir=''"]
    for message, what in zip(messages, named, strict=True):
        assert what in message and message.startswith("parallelize: offload='disk'")
