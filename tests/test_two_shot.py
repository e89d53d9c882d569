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
MAX_PIECES = 1 << 18  # kMaxTwoShotPieces (csrc/core/base/config.h)


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
    problems += _reduce_scatter_checks(inputs, group, n, piece_bytes)
    problems += _all_gather_checks(inputs, group, n)
    dist.destroy_process_group(group)
    return problems


def _reduce_scatter_checks(inputs: list[torch.Tensor], group, n: int,
                           piece_bytes: int) -> list[str]:
    """reduce_scatter of every rank's whole input (n blocks), against the rank-order sums
    of this rank's block: equal where the two-shot runs; where a piece cannot hold a line
    of every block the ring does, which sums in ring order and rounds at every hop."""
    rank, problems = dist.get_rank(), []
    two_shot = piece_bytes // n >= 64

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        if two_shot:
            return torch.equal(got, want)
        tolerance = 0.1 if got.itemsize == 2 else 1e-12  # bfloat16 rounded at each hop
        return torch.allclose(got.double(), want.double(), rtol=tolerance, atol=tolerance)
    per_rank = inputs[0].numel() // n
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    blocks = [t[: n * per_rank] for t in inputs]
    out = torch.full((per_rank,), -1.0, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, blocks[rank].clone(), group=group)
    if not same(out, _in_rank_order([b[mine] for b in blocks])):
        problems.append("reduce_scatter SUM float64")
    dist.reduce_scatter_tensor(out, blocks[rank].clone(), op=dist.ReduceOp.AVG, group=group)
    if not same(out, _in_rank_order([b[mine] for b in blocks]) * (1.0 / n)):
        problems.append("reduce_scatter AVG float64")
    x = blocks[rank].clone()  # the output is this rank's block of the input
    dist.reduce_scatter_tensor(x[mine], x, group=group)
    if not same(x[mine], _in_rank_order([b[mine] for b in blocks])):
        problems.append("reduce_scatter into its own block of the input")
    halves = [b.to(torch.bfloat16) for b in blocks]
    out16 = torch.empty(per_rank, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out16, halves[rank], group=group)
    want = _in_rank_order([h[mine].float() for h in halves]).to(torch.bfloat16)
    if not same(out16, want):
        problems.append("reduce_scatter SUM bfloat16")
    return problems


def _all_gather_checks(inputs: list[torch.Tensor], group, n: int) -> list[str]:
    """all_gather into a fresh tensor, into an unaligned slice, and in place (the input
    is this rank's block of the output)."""
    rank, problems = dist.get_rank(), []
    count = inputs[0].numel()
    out = torch.full((n * count,), -1.0, dtype=torch.float64)
    dist.all_gather_into_tensor(out, inputs[rank], group=group)
    if not torch.equal(out, torch.cat(inputs)):
        problems.append("all_gather float64")
    big = torch.zeros(n * count + 4, dtype=torch.float64)
    dist.all_gather_into_tensor(big[1:1 + n * count], inputs[rank], group=group)
    if not (torch.equal(big[1:1 + n * count], torch.cat(inputs)) and not big[0]
            and not big[1 + n * count:].any()):
        problems.append("all_gather into an unaligned slice")
    out = torch.zeros(n * count, dtype=torch.float64)
    out[rank * count:(rank + 1) * count] = inputs[rank]
    dist.all_gather_into_tensor(out, out[rank * count:(rank + 1) * count], group=group)
    if not torch.equal(out, torch.cat(inputs)):
        problems.append("all_gather in place")
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


# Each op at three message sizes as the core counts them (all_reduce's buffer,
# reduce_scatter's whole input, all_gather's input): 4 KiB, 8 KiB and 1 MiB.
def _op_calls(group) -> dict[str, list]:
    n = dist.get_world_size(group)

    def reduce_scatter(numel: int) -> None:
        numel -= numel % n
        dist.reduce_scatter_tensor(torch.empty(numel // n), torch.ones(numel), group=group)

    def all_gather(numel: int) -> None:
        dist.all_gather_into_tensor(torch.empty(n * numel), torch.ones(numel), group=group)

    ops = {"all_reduce": lambda numel: dist.all_reduce(torch.ones(numel), group=group),
           "reduce_scatter": reduce_scatter, "all_gather": all_gather}
    return {name: [lambda op=op, numel=numel: op(numel) for numel in (1024, 2048 + n, 1 << 18)]
            for name, op in ops.items()}


def _algorithms_taken(env: dict[str, str]) -> dict[str, list[str]]:
    """What the TRACE log names for each op of _op_calls, in a group made with ``env``:
    the last word before the reason, per call."""
    os.environ.update(env, PYCOMM_DEBUG="TRACE", PYCOMM_DEBUG_SUBSYS="COLL")
    try:
        group = dist.new_group(backend="pycomm")
    finally:
        for key in (*env, "PYCOMM_DEBUG", "PYCOMM_DEBUG_SUBSYS"):
            del os.environ[key]
    calls = _op_calls(group)
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            for op_calls in calls.values():
                for call in op_calls:
                    call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        dist.destroy_process_group(group)
        log.seek(0)
        lines = log.read().splitlines()
    return {name: [line.split(": ")[-1].split(" (")[0] for line in lines if f" {name} " in line]
            for name in calls}


def test_direct_size_before_the_two_shot_and_a_forced_algorithm_wins(pool):
    def expect(env: dict[str, str], **algorithms: list[str]) -> None:
        for taken in pool.run(_algorithms_taken, env):
            assert taken == algorithms, (env, taken)

    def every_op(algorithms: list[str]) -> dict[str, list[str]]:
        return dict.fromkeys(("all_reduce", "reduce_scatter", "all_gather"), algorithms)

    # 64 KiB is the direct size of ranks that share cores, measured against the ring:
    # all_reduce's two-shot overtakes direct past 4 KiB; the others' keep it.
    expect({"PYCOMM_DIRECT_BYTES": "65536"}, all_reduce=["direct", "two-shot", "two-shot"],
           reduce_scatter=["direct", "direct", "two-shot"],
           all_gather=["direct", "direct", "two-shot"])
    expect({"PYCOMM_DIRECT_BYTES": "4096"}, **every_op(["direct", "two-shot", "two-shot"]))
    expect({"PYCOMM_ALGO": "direct", "PYCOMM_DIRECT_BYTES": "65536"},
           **every_op(["direct", "direct", "ring"]))
    expect({"PYCOMM_ALGO": "ring"}, **every_op(["ring", "ring", "ring"]))
    expect({"PYCOMM_TWO_SHOT_BYTES": "0", "PYCOMM_DIRECT_BYTES": "4096"},
           **every_op(["direct", "ring", "ring"]))
    # A piece too small to hold a cache line of every rank's block: reduce_scatter rings.
    expect({"PYCOMM_TWO_SHOT_PIECE_BYTES": "128", "PYCOMM_DIRECT_BYTES": "0"},
           all_reduce=["two-shot"] * 3, reduce_scatter=["ring"] * 3, all_gather=["two-shot"] * 3)


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
