"""Many collectives of mixed kinds, sizes and algorithms in flight at once, with
send/recv interleaved: the direct areas' reuse, the channels' ordering across ops and
the two lanes must hold together. Inputs are derived from (op index, rank), so each
rank computes every expected result locally and exactly (small integers in float64)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all",
         "barrier"]


@pytest.fixture(scope="module", params=[3, 4])
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=60) as p:
        yield p


def _input(i: int, rank: int, count: int) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) % 13) + 100 * rank + i


def _plan(seed: int, n_ops: int, world: int) -> list[tuple[str, int, int]]:
    """The same (kind, count, root) list on every rank; sizes straddle the direct/ring
    threshold and chunk boundaries."""
    rng = random.Random(seed)
    sizes = [0, 1, 7, 1000, 16_384, 16_385, 70_001, 300_000]
    return [(rng.choice(KINDS), rng.choice(sizes), rng.randrange(world)) for _ in range(n_ops)]


def _issue(kind: str, i: int, count: int, root: int):
    """Starts op i asynchronously; returns (work, output, expected)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _input(i, rank, count)
    total = sum(_input(i, r, count) for r in range(n)) if count else x
    if kind == "all_reduce":
        return dist.all_reduce(x, async_op=True), x, total
    if kind == "broadcast":
        return dist.broadcast(x, root, async_op=True), x, _input(i, root, count)
    if kind == "reduce":
        expected = total if rank == root else _input(i, rank, count)
        return dist.reduce(x, root, async_op=True), x, expected
    if kind == "all_gather":
        out = torch.empty(count * n, dtype=torch.float64)
        expected = torch.cat([_input(i, r, count) for r in range(n)])
        return dist.all_gather_into_tensor(out, x, async_op=True), out, expected
    if kind == "reduce_scatter":
        full = [_input(i, r, count * n) for r in range(n)]
        out = torch.empty(count, dtype=torch.float64)
        expected = sum(f[rank * count:(rank + 1) * count] for f in full) if count else out
        return dist.reduce_scatter_tensor(out, full[rank], async_op=True), out, expected
    if kind == "all_to_all":
        src = _input(i, rank, count * n)
        out = torch.empty(count * n, dtype=torch.float64)
        expected = torch.cat([_input(i, r, count * n)[rank * count:(rank + 1) * count]
                              for r in range(n)])
        return dist.all_to_all_single(out, src, async_op=True), out, expected
    return dist.barrier(async_op=True), torch.empty(0), torch.empty(0)


def _mixed(seed: int, n_ops: int) -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    pending = []
    p2p = []
    for i, (kind, count, root) in enumerate(_plan(seed, n_ops, n)):
        pending.append((i, kind, *_issue(kind, i, count, root)))
        if i % 10 == 0:  # a ring exchange on the send/recv lane, while collectives run
            recv = torch.empty(50_000, dtype=torch.float64)
            p2p.append((dist.irecv(recv, (rank - 1) % n), recv, _input(i, (rank - 1) % n, 50_000)))
            p2p.append((dist.isend(_input(i, rank, 50_000), (rank + 1) % n), None, None))
    problems = []
    for i, kind, work, out, expected in pending:
        work.wait()
        if not torch.equal(out, expected):
            problems.append(f"op {i} {kind}[{out.numel()}] wrong on rank {rank}")
    for work, got, expected in p2p:
        work.wait()
        if got is not None and not torch.equal(got, expected):
            problems.append(f"a recv on rank {rank} got wrong data")
    return problems


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_async_collectives_and_send_recv(pool, seed):
    results = pool.run(_mixed, seed, 120)
    assert results == [[]] * pool.world_size, results
