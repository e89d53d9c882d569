"""The two-shot all_reduce (csrc/core/algorithms/two_shot.cc): more than two ranks, past
the direct size, every rank stages a piece in its own stage area, reduces its part of
every rank's stage and copies the other parts out of their owners' stages.

- For any element count and piece size (pieces of one cache line to many, parts that
  end mid-line, a tensor that is not line-aligned), at 2 and 3 ranks, the result is the
  float64 reference, AVG scaled once, bfloat16 summed in float32 and rounded once, and
  every rank's bits are the same (bfloat16, MAX with NaNs).
- It is what runs: a group's first all_reduce past the direct size reserves exactly the
  ranks' stage areas in /dev/shm, and one with PYCOMM_TWO_SHOT_BYTES=0 does not.
- Settings it cannot honour are refused, naming them.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _segments import segment_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

WORLD = 3
MAX_PIECES = 1 << 18  # kMaxTwoShotPieces (csrc/core/runtime/config.h)


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, backend="pycomm", pg_timeout_s=30) as p:
        yield p


def _group(piece_bytes: int, ranks: list[int], two_shot: bool = True):
    """A new pycomm group over ``ranks`` taking the two-shot for every size (or never)."""
    env = {"PYCOMM_DIRECT_BYTES": "0", "PYCOMM_TWO_SHOT_PIECE_BYTES": str(piece_bytes),
           "PYCOMM_TWO_SHOT_BYTES": str(piece_bytes * MAX_PIECES if two_shot else 0)}
    os.environ.update(env)
    try:
        return dist.new_group(ranks=ranks, backend="pycomm")
    finally:
        for key in env:
            del os.environ[key]


def _everyones(t: torch.Tensor, group, n: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return out


def _same_bits(ts: list[torch.Tensor], as_int: torch.dtype) -> bool:
    return all(torch.equal(t.view(as_int), ts[0].view(as_int)) for t in ts)


def _in_rank_order(ts: list[torch.Tensor]) -> torch.Tensor:
    total = ts[0].clone()
    for t in ts[1:]:
        total += t
    return total


def _two_shot_ops(count: int, piece_bytes: int, n: int) -> list[str]:
    ranks = list(range(n))
    group = _group(piece_bytes, ranks)
    rank = dist.get_rank()
    problems: list[str] = []
    if rank >= n:
        return problems
    gen = torch.Generator().manual_seed(count)
    inputs = [torch.randn(count, dtype=torch.float64, generator=gen) for _ in ranks]

    x = inputs[rank].clone()
    dist.all_reduce(x, group=group)
    if not torch.equal(x, _in_rank_order(inputs)):
        problems.append("all_reduce SUM float64")

    x = inputs[rank].clone()
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
    if not torch.equal(x, _in_rank_order(inputs) * (1.0 / n)):
        problems.append("all_reduce AVG float64")

    # Three elements into a larger buffer: neither the input nor a part is line-aligned.
    big = torch.zeros(count + 5, dtype=torch.float64)
    big[3:3 + count] = inputs[rank]
    dist.all_reduce(big[3:3 + count], group=group)
    if not (torch.equal(big[3:3 + count], _in_rank_order(inputs)) and not big[:3].any()
            and not big[3 + count:].any()):
        problems.append("all_reduce of an unaligned slice")

    halves = [t.to(torch.bfloat16) for t in inputs]
    x = halves[rank].clone()
    dist.all_reduce(x, group=group)
    if not torch.equal(x, _in_rank_order([h.float() for h in halves]).to(torch.bfloat16)):
        problems.append("all_reduce SUM bfloat16")
    if not _same_bits(_everyones(x, group, n), torch.int16):
        problems.append("bfloat16 results differ between the ranks")

    x = inputs[rank].float()
    x[::7] = float("nan")
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    if not _same_bits(_everyones(x, group, n), torch.int32):
        problems.append("MAX with NaNs differs between the ranks")

    ints = (inputs[rank] * 1000).to(torch.int32)
    dist.all_reduce(ints, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(ints, torch.stack([(t * 1000).to(torch.int32) for t in inputs]).amin(0)):
        problems.append("all_reduce MIN int32")
    dist.destroy_process_group(group)
    return problems


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(min_value=0, max_value=30_000),
    # 64: one line per piece, so a part may be empty; 192 and 12288 split unevenly.
    piece_bytes=st.sampled_from([64, 192, 4096, 12288, 65536]),
    n=st.sampled_from([2, 3]),
)
def test_two_shot_any_boundaries(pool, count, piece_bytes, n):
    results = pool.run(_two_shot_ops, count, piece_bytes, n)
    assert results == [[]] * WORLD, f"count={count} piece={piece_bytes} n={n}: {results}"


# --- what runs -------------------------------------------------------------------------


def _stage_bytes_reserved(piece_bytes: int, two_shot: bool) -> dict:
    group = _group(piece_bytes, list(range(WORLD)), two_shot=two_shot)
    x = torch.ones(1 << 16)  # 256 KiB: past the direct size (0 here)
    dist.all_reduce(x, group=group)  # the ring's channel, or the stage areas, reserved now
    dist.barrier(group=group)
    before = segment_bytes()
    for _ in range(3):
        dist.all_reduce(x, group=group)
    steady = segment_bytes() - before
    right = bool((x == WORLD ** 4).all())
    dist.destroy_process_group(group)
    fresh = _group(piece_bytes, list(range(WORLD)), two_shot=two_shot)
    dist.barrier(group=fresh)
    before = segment_bytes()
    dist.all_reduce(torch.ones(1 << 16), group=fresh)
    first = segment_bytes() - before
    dist.destroy_process_group(fresh)
    return {"first": first, "steady": steady, "right": right}


def test_the_first_two_shot_reserves_this_ranks_stage_areas(pool):
    piece = 64 << 10
    took = pool.run(_stage_bytes_reserved, piece, True)
    assert all(r["right"] for r in took), took
    # Every rank's two parities of two pieces (each parity in whole pages), in the one
    # file all ranks map; nothing more once reserved.
    assert [r["first"] for r in took] == [WORLD * 4 * piece] * WORLD, took
    assert [r["steady"] for r in took] == [0] * WORLD, took
    ring = pool.run(_stage_bytes_reserved, piece, False)
    assert all(r["right"] for r in ring), ring
    assert all(r["first"] != WORLD * 4 * piece for r in ring), ring  # the ring's channels


def _algorithms_taken(env: dict[str, str]) -> list[str]:
    """What the TRACE log names for all_reduces of 4 and 8 KiB and of 1 MiB, in a group
    made with ``env``: the last word before the reason, per op."""
    os.environ.update(env, PYCOMM_DEBUG="TRACE", PYCOMM_DEBUG_SUBSYS="COLL")
    try:
        group = dist.new_group(backend="pycomm")
    finally:
        for key in (*env, "PYCOMM_DEBUG", "PYCOMM_DEBUG_SUBSYS"):
            del os.environ[key]
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            for numel in (1024, 2048, 1 << 18):
                dist.all_reduce(torch.ones(numel), group=group)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        dist.destroy_process_group(group)
        log.seek(0)
        ops = [line for line in log.read().splitlines() if " all_reduce " in line]
    return [line.split(": ")[-1].split(" (")[0] for line in ops]


def test_direct_stops_at_4_kib_before_the_two_shot_and_a_forced_algorithm_wins(pool):
    # 64 KiB is the direct size of ranks that share cores, measured against the ring.
    for taken in pool.run(_algorithms_taken, {"PYCOMM_DIRECT_BYTES": "65536"}):
        assert taken == ["direct", "two-shot", "two-shot"], taken
    forced = {"PYCOMM_ALGO": "direct", "PYCOMM_DIRECT_BYTES": "65536"}
    for taken in pool.run(_algorithms_taken, forced):
        assert taken == ["direct", "direct", "ring"], taken
    for taken in pool.run(_algorithms_taken, {"PYCOMM_ALGO": "ring"}):
        assert taken == ["ring", "ring", "ring"], taken


# --- settings it cannot honour --------------------------------------------------------


def _group_refused(env: dict[str, str]) -> str:
    os.environ.update(env)
    try:
        dist.new_group(backend="pycomm")
    except Exception as exc:
        return str(exc)
    finally:
        for key in env:
            del os.environ[key]
    return "created"


def test_more_pieces_than_an_op_has_steps_is_refused(pool):
    env = {"PYCOMM_TWO_SHOT_PIECE_BYTES": "64", "PYCOMM_TWO_SHOT_BYTES": str(64 * MAX_PIECES + 1)}
    for message in pool.run(_group_refused, env):
        assert "PYCOMM_TWO_SHOT_BYTES=16777217" in message, message
        assert "PYCOMM_TWO_SHOT_PIECE_BYTES=64" in message, message
