"""``pycomm.use_arena``: tensors torch allocates by itself (DDP's gradient buckets,
FSDP2's all-gather and reduce-scatter buffers) taken from pycomm's shared-memory arena,
so their collectives are zero-copy.

In one process: which allocations are routed (threshold, nesting, the calling thread
only, tensors outliving the block, memory given back). On 2 ranks: unchanged DDP
training inside the block, on two models pycomm did not write (an MLP and torch's
transformer encoder layer) and on its GPT, and FSDP2 on the MLP and the GPT, against a
single process on the whole batch; every collective above the direct size zero-copy
when every rank opens the block, the streamed fallback on all ranks when only one does
(tests/_use_arena_ranks.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import _dp_scenarios as gpt_case
import _interop_models as im
import pytest
import torch

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

ZERO_COPY = "zero-copy (every rank's buffer is in the arena)"
FALLBACK = "(not every rank's buffer is in the arena)"
SINGLE_TOL = {"rtol": 1e-4, "atol": 1e-5}
MODELS = ("mlp", "transformer", "gpt")
FSDP2_MODELS = ("mlp", "gpt")  # fully_shard per Linear / per block, then the root
EVERY_RUN = [*MODELS, *(f"fsdp2-{m}" for m in FSDP2_MODELS)]


def test_routes_this_threads_large_allocations_only():
    import pycomm

    before = torch.empty(1 << 18)
    with pycomm.use_arena(min_bytes=1 << 20):
        big, small = torch.empty(1 << 18), torch.empty(16)
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(pycomm.in_arena(torch.empty(1 << 18))))
        t.start()
        t.join()
        with pycomm.use_arena(min_bytes=64):  # nested: the inner threshold counts
            inner = torch.zeros(16)
        after_inner = torch.empty(16)
    after = torch.empty(1 << 18)
    assert pycomm.in_arena(big) and pycomm.in_arena(inner)
    assert not any(pycomm.in_arena(t) for t in (before, small, after_inner, after))
    assert other == [False], "another thread's allocation was routed"
    assert torch.equal(inner, torch.zeros(16))
    big.fill_(3.0)  # arena memory stays usable after the block
    assert big.sum().item() == 3.0 * (1 << 18)


def test_kernels_scratch_memory_in_and_out_of_the_block():
    """torch kernels take scratch memory by raw_allocate and free it through the CPU
    allocator's raw deleter, which must free both the arena's and the replaced
    allocator's pointers (a missing one aborted the process)."""
    import pycomm

    x = torch.randn(1 << 18)
    expected = torch.nn.functional.gelu(x.double()).float()
    with pycomm.use_arena(min_bytes=64):
        inside = torch.nn.functional.gelu(x)
    outside = torch.nn.functional.gelu(x)
    torch.testing.assert_close(inside, expected)
    torch.testing.assert_close(outside, expected)


def test_memory_goes_back_to_the_arena():
    import pycomm

    live = pycomm.arena_stats()["live"]
    with pycomm.use_arena(min_bytes=1 << 16):
        tensors = [torch.empty(1 << 16) for _ in range(4)]
    assert pycomm.arena_stats()["live"] >= live + 4 * (1 << 18)
    del tensors
    assert pycomm.arena_stats()["live"] == live


def test_a_forked_child_frees_and_routes():
    """A child forked with routed tensors alive frees them (its arena is a new one, which
    does not own them) and routes its own allocations to that arena."""
    import pycomm

    with pycomm.use_arena(min_bytes=64):
        inherited = torch.ones(1 << 12)
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions out of here
        ok = False
        try:
            ok = inherited.sum().item() == float(1 << 12)
            del inherited  # freed through the router's deleter, in a fresh arena
            with pycomm.use_arena(min_bytes=64):
                mine = torch.empty(1 << 12).fill_(2.0)
            ok = ok and pycomm.in_arena(mine) and mine.sum().item() == 2.0 * (1 << 12)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish within 30 s")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's checks failed"
    assert pycomm.in_arena(inherited) and inherited.sum().item() == float(1 << 12)


def test_refuses_a_zero_threshold():
    import pycomm

    with (pytest.raises(ValueError, match="min_bytes must be at least 1, got 0"),
          pycomm.use_arena(min_bytes=0)):
        pass


@pytest.fixture(scope="module")
def ranks():
    """Every model with every rank routed, and with rank 0 only, in one 2-rank pool."""
    import _use_arena_ranks as ua

    with RankPool(2, backend="pycomm", pg_timeout_s=60.0) as pool:
        runs = {(m, who): pool.run(ua.train, m, who, timeout_s=300)
                for m in MODELS for who in ("all", "rank0")}
        runs |= {(f"fsdp2-{m}", who): pool.run(ua.train_fsdp2, m, who, timeout_s=300)
                 for m in FSDP2_MODELS for who in ("all", "rank0")}
        yield runs


def _reference(model: str) -> dict:
    if model == "gpt":
        return gpt_case.reference(2, "sgd")
    if model == "fsdp2-gpt":
        return gpt_case.reference(2, "sgd")
    if model.startswith("fsdp2-"):
        return im.reference_run(2, model.removeprefix("fsdp2-"), optim="adam")
    return im.reference_run(2, model)


@pytest.mark.parametrize("who", ["all", "rank0"])
@pytest.mark.parametrize("model", EVERY_RUN)
def test_training_in_the_arena_matches_one_process(ranks, model, who):
    results = ranks[(model, who)]
    for rank, r in enumerate(results[1:], start=1):
        for i, (p0, p) in enumerate(zip(results[0]["params"], r["params"], strict=True)):
            assert torch.equal(p0, p), f"{model}: rank {rank} parameter {i} differs from rank 0"
    single = _reference(model)
    torch.testing.assert_close(results[0]["params"], single["params"], **SINGLE_TOL)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(single["losses"]), **SINGLE_TOL)


@pytest.mark.parametrize("model", EVERY_RUN)
def test_the_arena_changes_no_bit(ranks, model):
    """Zero-copy and the streamed path add the same two numbers: the same result."""
    for rank, (zero_copy, streamed) in enumerate(zip(ranks[(model, "all")],
                                                     ranks[(model, "rank0")], strict=True)):
        for i, (a, b) in enumerate(zip(zero_copy["params"], streamed["params"], strict=True)):
            assert torch.equal(a, b), f"{model}: rank {rank} parameter {i} differs"


@pytest.mark.parametrize("model", MODELS)
def test_ddp_buckets_are_zero_copy_when_every_rank_routes(ranks, model):
    for rank, r in enumerate(ranks[(model, "all")]):
        steps = len(r["losses"])  # at least one bucket all-reduce per step
        assert len(r["paths"]) >= steps, f"{model}: rank {rank} logged {r['paths']}"
        wrong = [p for p in r["paths"] if p != ZERO_COPY]
        assert not wrong, f"{model}: rank {rank}: all-reduces not zero-copy: {wrong[:3]}"
        # .grad views of the buckets above the threshold (a last small bucket is not)
        assert any(r["grads_in_arena"]), f"{model}: rank {rank}: no .grad is in the arena"


@pytest.mark.parametrize("model", [f"fsdp2-{m}" for m in FSDP2_MODELS])
def test_fsdp2_collectives_are_zero_copy_when_every_rank_routes(ranks, model):
    for rank, r in enumerate(ranks[(model, "all")]):
        assert len(r["paths"]) >= len(r["losses"]), f"{model}: rank {rank} logged {r['paths']}"
        wrong = [p for p in r["paths"] if p != ZERO_COPY]
        assert not wrong, f"{model}: rank {rank}: not zero-copy: {wrong[:3]}"


@pytest.mark.parametrize("model", EVERY_RUN)
def test_every_rank_falls_back_when_one_does_not_route(ranks, model):
    for rank, r in enumerate(ranks[(model, "rank0")]):
        assert r["paths"], f"{model}: rank {rank} logged no all-reduce above the direct size"
        wrong = [p for p in r["paths"] if FALLBACK not in p]
        assert not wrong, f"{model}: rank {rank}: not the fallback: {wrong[:3]}"
