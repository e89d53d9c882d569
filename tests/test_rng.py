"""pycomm.parallel.rng: the tracker and its seeds on one process (CUDA's generators played by CPU
ones), then every recompute path at 2 pipeline stages x TP 2 (one 4-rank spawn)."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import pycomm.parallel.rng as rng
from pycomm.parallel.recompute import checkpoint
from pycomm.parallel.rng import REPLICATED, TENSOR_PARALLEL, TRACKER, RNGTracker, seed_streams
from pycomm.parallel.tensor import TrackedDropout


def _on_stream(tracker, name="a"):
    with tracker.fork(name):
        return torch.rand(3)


def test_fork_continues_its_stream_and_leaves_the_default_generator():
    tracker = RNGTracker()
    tracker.add("a", 7)
    torch.manual_seed(0)
    first = _on_stream(tracker)
    outside = torch.rand(3)
    second = _on_stream(tracker)
    assert torch.equal(torch.cat([first, second]),
                       torch.rand(6, generator=torch.Generator().manual_seed(7)))
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(3))


def test_an_unseeded_stream_names_the_call_that_seeds_it():
    with pytest.raises(KeyError,
                       match=r"'b' is not seeded: call pycomm.parallel.rng.model_parallel"):
        _on_stream(RNGTracker(), "b")


def test_an_unseeded_stream_that_nothing_draws_from_needs_no_seed():
    """A model without dropout (or in eval) forks into the per-rank stream and draws
    nothing: it runs, and the default generator is untouched."""
    torch.manual_seed(5)
    with RNGTracker().fork("b"):
        torch.ones(3).sum()
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(5)))


def test_replay_draws_again_and_leaves_every_generator_as_it_found_it():
    tracker = RNGTracker()
    tracker.add("a", 1)
    torch.manual_seed(0)

    def draws():
        return torch.cat([torch.rand(2), _on_stream(tracker)])

    snap = tracker.snapshot()
    first, second = draws(), draws()
    tracker.restore(snap)
    draws()
    replay = tracker.replay(snap)
    with replay:
        assert torch.equal(draws(), first)
    assert torch.equal(draws(), second)  # as if the replay had not happened
    with replay:  # again: a graph kept by retain_graph is recomputed once per backward
        assert torch.equal(draws(), first)


def _dropout_step(how):
    """Gradients of a dropout region on every stream, and what each generator draws
    next, plain or checkpointed ``how``."""
    seed_streams(123, tp_rank=0, pp_rank=0)
    lin = nn.Linear(16, 16)
    drops = nn.Sequential(TrackedDropout(0.5, REPLICATED), TrackedDropout(0.5, TENSOR_PARALLEL),
                          nn.Dropout(0.5))
    x = torch.randn(8, 16, requires_grad=True)

    def f(t):
        return drops(lin(t))

    if how == "pycomm.parallel.recompute":
        out = checkpoint(f, x)
    elif how == "torch+tracker":
        out = torch_checkpoint(f, x, use_reentrant=False, preserve_rng_state=False,
                               context_fn=TRACKER.checkpoint_context)
    else:
        out = f(x)
    out.sum().backward()
    after = [torch.rand(2)] + [_on_stream(TRACKER, s) for s in (REPLICATED, TENSOR_PARALLEL)]
    return [lin.weight.grad, x.grad, *after]


@pytest.mark.parametrize("how", ["pycomm.parallel.recompute", "torch+tracker"])
def test_checkpoints_replay_every_stream_and_continue_them_as_without(how):
    for plain, checkpointed in zip(_dropout_step(None), _dropout_step(how), strict=True):
        assert torch.equal(plain, checkpointed)


def _stream_draws(tp_rank, pp_rank):
    seed_streams(1234, tp_rank, pp_rank)
    return {"default": torch.rand(4),
            **{s: _on_stream(TRACKER, s) for s in (REPLICATED, TENSOR_PARALLEL)}}


def test_seeds_are_alike_where_they_must_be_and_differ_per_stage_and_tp_rank():
    stage0 = [_stream_draws(t, 0) for t in (0, 1)]
    stage1 = [_stream_draws(t, 1) for t in (0, 1)]
    for stage in (stage0, stage1):  # the TP ranks of a stage
        assert torch.equal(stage[0]["default"], stage[1]["default"])
        assert torch.equal(stage[0][REPLICATED], stage[1][REPLICATED])
        assert not torch.equal(stage[0][TENSOR_PARALLEL], stage[1][TENSOR_PARALLEL])
    for name in ("default", REPLICATED, TENSOR_PARALLEL):  # stages never repeat masks
        assert not torch.equal(stage0[0][name], stage1[0][name]), name
    # stage 0 keeps the seeds of before pipeline stages were known (Megatron-LM's too)
    assert torch.equal(stage0[1][TENSOR_PARALLEL],
                       torch.rand(3, generator=torch.Generator().manual_seed(1234 + 2718 + 1)))
    assert torch.equal(stage1[0][REPLICATED],
                       torch.rand(3, generator=torch.Generator().manual_seed(1234 + 100 + 1)))
    with pytest.raises(ValueError, match=r"pp_rank \(-1\) and tp_rank \(0\) must be >= 0"):
        seed_streams(1, 0, -1)


class _FakeCuda:
    """Two CUDA devices' default generators, played by CPU generators (the tracker's CUDA
    path cannot run on a CPU build otherwise)."""

    def __init__(self, monkeypatch):
        self.gens = [torch.Generator().manual_seed(100 + d) for d in range(2)]
        self.device = 0
        cuda = torch.cuda
        for name, fn in {
            "is_initialized": lambda: True,
            "current_device": lambda: self.device,
            "get_rng_state": lambda device: self.gens[device].get_state(),
            "set_rng_state": lambda state, device: self.gens[device].set_state(state),
            "get_rng_state_all": lambda: [g.get_state() for g in self.gens],
            "set_rng_state_all": lambda states: [g.set_state(s)
                                                 for g, s in zip(self.gens, states, strict=True)],
        }.items():
            monkeypatch.setattr(cuda, name, fn)
        monkeypatch.setattr(rng, "_seeded_cuda_state",
                            lambda seed, device: torch.Generator().manual_seed(seed).get_state())

    def rand(self):
        """A draw on the current device's generator (dropout on a CUDA tensor)."""
        return torch.rand(3, generator=self.gens[self.device])


def test_fork_swaps_the_current_cuda_devices_generator(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    tracker = RNGTracker()
    tracker.add("a", 7)
    untouched = [torch.Generator().manual_seed(100 + d) for d in range(2)]
    stream = torch.Generator().manual_seed(7)
    for _ in range(2):
        with tracker.fork("a"):
            assert torch.equal(cuda.rand(), torch.rand(3, generator=stream))
        assert torch.equal(cuda.rand(), torch.rand(3, generator=untouched[0]))
    cuda.device = 1  # the stream on another device starts from its seed there
    with tracker.fork("a"):
        assert torch.equal(cuda.rand(), torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(cuda.rand(), torch.rand(3, generator=untouched[1]))


def test_replay_restores_cuda_generators_and_the_streams_cuda_states(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    tracker = RNGTracker()
    tracker.add("a", 7)

    def draws():
        with tracker.fork("a"):
            on_stream = cuda.rand()
        return torch.cat([cuda.rand(), on_stream])

    draws()
    snap = tracker.snapshot()
    first = draws()
    after = tracker.snapshot()
    second = draws()
    tracker.restore(after)
    with tracker.replay(snap):
        assert torch.equal(draws(), first)
    assert torch.equal(draws(), second)  # as if the replay had not happened


@pytest.fixture(scope="module")
def pp2_tp2(require_pycomm):
    from _rng_scenarios import run_all

    from pycomm.testing import run_ranks

    return run_ranks(run_all, 4, 4, timeout_s=600.0)


def _assert_identical(run, plain, what):
    assert run["loss"] == plain["loss"], what
    assert run["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        diff = (run["grads"][name] - grad).abs().max().item()
        assert torch.equal(run["grads"][name], grad), f"{what}: {name} off by {diff:.3g}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_pipeline_rematerialization_replays_tensor_parallel_dropout(pp2_tp2, schedule, mode):
    for r in pp2_tp2:
        plain = r[("pipeline", schedule, "never")]
        _assert_identical(r[("pipeline", schedule, mode)], plain,
                          f"stage {r['stage']} {schedule} checkpoint={mode!r}")


@pytest.mark.parametrize("sp", [False, True])
def test_checkpointed_tensor_parallel_blocks_replay_dropout(pp2_tp2, sp):
    for r in pp2_tp2:
        plain = r[("blocks", sp, None)]
        for partition in (False,) if sp else (False, True):
            _assert_identical(r[("blocks", sp, partition)], plain,
                              f"sequence_parallel={sp} partition={partition}")


def test_partitioned_activations_with_sequence_parallelism_are_refused(pp2_tp2):
    for r in pp2_tp2:
        assert "sequence parallel" in r["pa_sp"], r["pa_sp"]
        assert "partition_group" in r["pa_sp"], r["pa_sp"]


def test_partitioned_inputs_that_differ_across_the_group_are_refused(pp2_tp2):
    for r in pp2_tp2:
        assert "differs across" in r["pa_differing"], r["pa_differing"]


def test_pipeline_over_checkpointed_blocks_replays_too(pp2_tp2):
    for r in pp2_tp2:  # blocks checkpointed with P_a, inside the stage's rematerialization
        _assert_identical(r[("pipeline", "nested")], r[("pipeline", "1f1b", "never")],
                          f"stage {r['stage']} nested")


def test_partitioning_a_sequence_parallel_block_is_refused(pp2_tp2):
    for r in pp2_tp2:
        assert "blocks.0" not in r["pa_sp_block"]  # named within the block
        assert "attn.c_proj (RowParallelLinear) is sequence parallel" in r["pa_sp_block"]


def test_seeds_follow_the_tp_and_pp_coordinates(pp2_tp2):
    by_rank = [r["seeding"] for r in pp2_tp2]
    for r in by_rank:
        for name, draw in r["groups"].items():  # a DeviceMesh gives the same seeds
            assert torch.equal(r["mesh"][name], draw), name
        assert "global rank" in r["not_in_group"] and "not in the tp_group" in r["not_in_group"]
    for a, b in ((0, 1), (2, 3)):  # TP ranks of a stage
        assert torch.equal(by_rank[a]["groups"]["replicated"], by_rank[b]["groups"]["replicated"])
        assert not torch.equal(by_rank[a]["groups"]["tensor-parallel"],
                               by_rank[b]["groups"]["tensor-parallel"])
    for name in ("default", "replicated", "tensor-parallel"):  # the same TP rank, two stages
        assert not torch.equal(by_rank[0]["groups"][name], by_rank[2]["groups"][name]), name
        assert torch.equal(by_rank[2]["no_pp"][name], by_rank[0]["groups"][name]), name
