"""Two ranks' all_reduce above the direct size: the pair exchange (all_reduce_pair.cc)
over channels whose buffers a sender picks lowest-free-first and grows while its
receiver is behind (transport/layout.h).

- For any element count, chunk size and channel depth, the result is the float64
  reference, AVG scaled once, and both ranks' results are bit-identical (bfloat16, and
  MAX with NaNs, where the order of the operands decides the bits).
- A rank whose peer is late sends its whole buffer ahead: its channel grows past its
  first buffers in /dev/shm, and the result is still right.
- A peer whose chunk names a buffer the channel does not have is refused, naming it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from _segments import segment_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

WORLD = 2
SETTINGS = ("PYCOMM_CHUNK_BYTES", "PYCOMM_SLOTS", "PYCOMM_ZERO_COPY")


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, backend="pycomm", pg_timeout_s=30) as p:
        yield p


def _group(chunk_bytes: int, slots: int, zero_copy: bool = True):
    """A new pycomm group with these channel settings (read when it is created)."""
    os.environ.update(PYCOMM_CHUNK_BYTES=str(chunk_bytes), PYCOMM_SLOTS=str(slots),
                      PYCOMM_ZERO_COPY=str(int(zero_copy)))
    try:
        return dist.new_group(backend="pycomm")
    finally:
        for key in SETTINGS:
            del os.environ[key]


def _both(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (over the same group, for a bit-for-bit comparison)."""
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t, group=group)
    return out


def _pair_ops(count: int, chunk_bytes: int, slots: int) -> list[str]:
    group = _group(chunk_bytes, slots)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(count)
    inputs = [torch.randn(count, dtype=torch.float64, generator=gen) for _ in range(WORLD)]
    problems = []

    x = inputs[rank].clone()
    dist.all_reduce(x, group=group)
    if not torch.equal(x, inputs[0] + inputs[1]):
        problems.append("all_reduce SUM float64")

    x = inputs[rank].clone()
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
    if not torch.equal(x, (inputs[0] + inputs[1]) * 0.5):
        problems.append("all_reduce AVG float64")

    # bfloat16 is summed in float32 and rounded once: the reference, and equal bits.
    halves = [t.to(torch.bfloat16) for t in inputs]
    x = halves[rank].clone()
    dist.all_reduce(x, group=group)
    if not torch.equal(x, (halves[0].float() + halves[1].float()).to(torch.bfloat16)):
        problems.append("all_reduce SUM bfloat16")
    a, b = _both(x, group)
    if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
        problems.append("bfloat16 results differ between the ranks")

    # NaNs on both sides at the same places: which one wins is the operands' order.
    x = inputs[rank].float()
    x[::7] = float("nan")
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    a, b = _both(x, group)
    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
        problems.append("MAX with NaNs differs between the ranks")
    dist.destroy_process_group(group)
    return problems


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(min_value=0, max_value=40_000),
    chunk_bytes=st.sampled_from([64, 192, 4096, 12296, 65536]),
    slots=st.sampled_from([2, 3, 5, 64]),
)
def test_pair_exchange_any_boundaries(pool, count, chunk_bytes, slots):
    results = pool.run(_pair_ops, count, chunk_bytes, slots)
    assert results == [[]] * WORLD, f"count={count} chunk={chunk_bytes} slots={slots}: {results}"


# --- a late peer: the sender runs ahead --------------------------------------------------


def _late_peer(delay_s: float) -> dict:
    chunk = 64 << 10
    # Without zero-copy, whose negotiation would meet the peer before any chunk moves.
    group = _group(chunk, 64, zero_copy=False)
    rank = dist.get_rank()
    count = 48 * chunk // 4  # 48 chunks: more than the 4 buffers a channel starts with
    x = torch.full((count,), float(rank + 1))
    dist.barrier(group=group)
    before = segment_bytes()
    if rank == 1:
        time.sleep(delay_s)
    start = time.monotonic()
    dist.all_reduce(x, group=group)
    waited = time.monotonic() - start
    grown = segment_bytes() - before
    right = bool(torch.equal(x, torch.full_like(x, 3.0)))
    dist.destroy_process_group(group)
    return {"grown": grown, "right": right, "waited": waited}


def test_a_sender_runs_ahead_of_a_late_peer(pool):
    rank0, rank1 = pool.run(_late_peer, 0.5)
    assert rank0["right"] and rank1["right"], (rank0, rank1)
    assert rank0["waited"] > 0.3, rank0  # it did wait for its peer...
    # ...having sent everything it could: its channel grew by (most of) 44 more buffers.
    assert rank0["grown"] >= 32 * (64 << 10), rank0


# --- a hostile peer ---------------------------------------------------------------------


def _bad_buffer(skew: int) -> str:
    from pycomm import _C

    group = _group(64 << 10, 8)
    rank = dist.get_rank()
    x = torch.ones(1 << 18)
    if rank == 1:
        _C._inject_buffer_fault(skew)
    try:
        dist.all_reduce(x, group=group)
    except dist.DistBackendError as exc:
        return str(exc)
    finally:
        _C._inject_buffer_fault(0)
    raise AssertionError(f"rank {rank}: a chunk in a buffer the channel lacks was used")


def test_a_chunk_naming_a_buffer_past_the_channel_is_refused():
    from pycomm.testing import run_ranks

    messages = run_ranks(_bad_buffer, WORLD, 8, pg_timeout_s=20)
    assert "rank 1 sent rank 0 a chunk of all_reduce float32[262144] SUM in buffer" in (
        messages[0]), messages[0]
    assert "of a channel of 8" in messages[0], messages[0]
    assert "rank 1 sent rank 0" in messages[1], messages[1]  # the job's one failure
