"""pycomm.empty/zeros: tensors in the shared-memory arena, and every collective on them
(zero-copy where every rank passes one, the ordinary path where not) against float64
references."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import pycomm
from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

SLAB = 64 << 20


def test_empty_and_zeros_shapes_dtypes_and_stats():
    before = pycomm.arena_stats()
    a = pycomm.zeros(3, 5, dtype=torch.bfloat16)
    b = pycomm.empty((7,), dtype=torch.int64)
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and bool((a == 0).all())
    assert b.shape == (7,) and pycomm.in_arena(a) and pycomm.in_arena(b[2:])
    assert not pycomm.in_arena(torch.zeros(4))
    during = pycomm.arena_stats()
    assert during["live"] >= before["live"] + 30 + 56
    assert during["peak"] >= during["live"] and during["reserved"] >= SLAB
    del a, b
    assert pycomm.arena_stats()["live"] == before["live"]


def test_a_shape_too_large_to_address_is_refused_before_allocating():
    before = pycomm.arena_stats()
    with pytest.raises(ValueError, match="more bytes than an address space holds"):
        pycomm.empty((1 << 40, 1 << 40), dtype=torch.float32)
    assert pycomm.arena_stats()["live"] == before["live"]


def test_freed_neighbours_coalesce_and_big_requests_get_their_own_slab():
    start = pycomm.arena_stats()
    blocks = [pycomm.empty(1 << 20, dtype=torch.uint8) for _ in range(3)]
    del blocks  # all three freed: the free space must be one block again
    assert pycomm.arena_stats()["largest_free"] == start["largest_free"] or start["slabs"] == 0
    big = pycomm.empty(SLAB + 1, dtype=torch.uint8)
    assert pycomm.arena_stats()["slabs"] >= start["slabs"] + 1
    assert pycomm.in_arena(big)


_TRIM_PROBE = """
import re, torch, pycomm
from pycomm.arena import return_freed_memory

def shmem_mib():
    return int(re.search(r"RssShmem:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) >> 10

kept = pycomm.empty(SLAB, dtype=torch.uint8).fill_(1)
del kept
before = shmem_mib()  # without trimming a freed block keeps its pages
return_freed_memory(1 << 20)
big = pycomm.empty(SLAB, dtype=torch.uint8).fill_(7)
small = pycomm.empty(1000, dtype=torch.uint8).fill_(3)
held = shmem_mib()
del big
stats = pycomm.arena_stats()
freed = shmem_mib()
again = pycomm.empty(SLAB, dtype=torch.uint8)
print(before, held, freed, stats["trimmed"], int(again.sum()), int(small.sum()))
"""


def test_freed_blocks_go_back_to_the_system_once_asked(tmp_path):
    """return_freed_memory: a freed block's pages leave the process (its shared memory
    falls by the block), a small live neighbour keeps its values, and the block handed
    out again is reserved anew (it reads zeros, not a SIGBUS)."""
    import subprocess
    import sys

    slab_mib = 64
    code = f"SLAB = {slab_mib << 20}\n" + _TRIM_PROBE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    before, held, freed, trimmed, again, small = map(int, out)
    assert before >= slab_mib - 1  # untrimmed: the freed block stays resident
    assert held - freed >= slab_mib - 1 and trimmed >= (slab_mib - 1) << 20
    assert again == 0 and small == 3000


@pytest.fixture(scope="module", params=[2, 3])
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=30) as p:
        yield p


def _ref(count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(count) * (rank + 3)) % 11 - 5).to(dtype)


def _block(t: torch.Tensor, i: int, count: int) -> torch.Tensor:
    return t[i * count:(i + 1) * count]


def _arena(t: torch.Tensor, registered: bool) -> torch.Tensor:
    if not registered:
        return t.clone()
    out = pycomm.empty(t.shape, dtype=t.dtype)
    return out.copy_(t)


def _every_collective(count: int, dtype: torch.dtype, who: str) -> list[str]:
    """Runs each collective with arena buffers on the ranks `who` names ("all", "some")."""
    rank, n = dist.get_rank(), dist.get_world_size()
    reg = who == "all" or rank % 2 == 0
    total = sum(_ref(count, r, torch.float64) for r in range(n))
    bad = []

    x = _arena(_ref(count, rank, dtype), reg)
    dist.all_reduce(x)
    if not torch.equal(x.double(), total):
        bad.append("all_reduce")

    full = _arena(_ref(count * n, rank, dtype), reg)
    out = _arena(torch.empty(count, dtype=dtype), reg)
    dist.reduce_scatter_tensor(out, full)
    expected = _block(sum(_ref(count * n, r, torch.float64) for r in range(n)), rank, count)
    if not torch.equal(out.double(), expected):
        bad.append("reduce_scatter")

    gathered = _arena(torch.zeros(count * n, dtype=dtype), reg)
    mine = gathered[rank * count:(rank + 1) * count]
    mine.copy_(_ref(count, rank, dtype))
    dist.all_gather_into_tensor(gathered, mine)  # in place, as FSDP does
    every = torch.cat([_ref(count, r, torch.float64) for r in range(n)])
    if not torch.equal(gathered.double(), every):
        bad.append("all_gather (in place)")

    b = _arena(_ref(count, rank, dtype), reg)
    dist.broadcast(b, n - 1)
    if not torch.equal(b.double(), _ref(count, n - 1, torch.float64)):
        bad.append("broadcast")

    for root in (0, n - 1):  # every rank reduces its part into the root's buffer
        r_in = _arena(_ref(count, rank, dtype), reg)
        mine_before = r_in.clone()
        dist.reduce(r_in, root)
        if rank == root and not torch.equal(r_in.double(), total):
            bad.append(f"reduce to {root}")
        if rank != root and not torch.equal(r_in, mine_before):
            bad.append(f"reduce to {root} changed a non-root input")

    a2a_in = _arena(_ref(count * n, rank, dtype), reg)
    a2a_out = _arena(torch.empty(count * n, dtype=dtype), reg)
    dist.all_to_all_single(a2a_out, a2a_in)
    exp = torch.cat([_block(_ref(count * n, r, torch.float64), rank, count) for r in range(n)])
    if not torch.equal(a2a_out.double(), exp):
        bad.append("all_to_all")
    return bad


@pytest.mark.parametrize("who", ["all", "some"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("count", [1000, 300_001])
def test_every_collective_on_arena_tensors(pool, count, dtype, who):
    results = pool.run(_every_collective, count, dtype, who)
    assert results == [[]] * pool.world_size, results


def _zero_copy_chosen() -> str:
    """The TRACE log of large all_reduces and broadcasts, of arena tensors and of ordinary
    ones, in a new group."""
    os.environ["PYCOMM_DEBUG"] = "TRACE"
    group = dist.new_group(backend="pycomm")
    del os.environ["PYCOMM_DEBUG"]
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            dist.all_reduce(pycomm.zeros(1 << 18), group=group)
            dist.all_reduce(torch.zeros(1 << 18), group=group)
            dist.broadcast(pycomm.zeros(1 << 18), 0, group=group)
            dist.broadcast(torch.zeros(1 << 18), 0, group=group)
            dist.reduce(pycomm.zeros(1 << 18), 0, group=group)
            n = dist.get_world_size()
            dist.all_to_all_single(torch.empty(n * 8), pycomm.zeros(n * 8), group=group)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        dist.destroy_process_group(group)
        log.seek(0)
        return log.read()


def test_debug_log_names_zero_copy_and_fallback(pool):
    for text in pool.run(_zero_copy_chosen):
        assert "zero-copy (every rank's buffer is in the arena)" in text, text
        # Two ranks exchange their buffers; more take the two-shot (at every size here).
        streamed = "pair" if pool.world_size == 2 else "two-shot"
        assert f"{streamed} (not every rank's buffer is in the arena)" in text, text
        lines = [line for line in text.splitlines() if "broadcast" in line]
        assert len(lines) == 2, text
        assert "zero-copy (every rank's buffer is in the arena)" in lines[0], text
        assert "chain (not every rank's buffer is in the arena)" in lines[1], text
        reduce = [line for line in text.splitlines() if " reduce " in f" {line} "]
        assert len(reduce) == 1 and "zero-copy" in reduce[0], text
        peers = pool.world_size - 1
        assert f"pairwise, {peers} of {peers} peers read in place" in text, text


def _all_to_all_pull_mismatch() -> str:
    """Rank 1 expects one element more from rank 0 than rank 0, whose input is in the
    arena (so rank 1 reads it in place), sends it. Run in its own group: the failure
    aborts that group, not the pool's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="pycomm", timeout=datetime.timedelta(seconds=5))
    send = [4] * n
    recv = [4] * n
    if rank == 1:
        recv[0] = 5
    x = pycomm.zeros(4 * n) if rank == 0 else torch.zeros(4 * n)
    out = torch.empty(sum(recv))
    try:
        dist.all_to_all_single(out, x, recv, send, group=group)
    except Exception as e:  # the message is what the test checks
        return str(e)
    finally:
        dist.destroy_process_group(group)
    return ""


def test_all_to_all_size_mismatch_on_a_pulled_block_names_both_ranks(pool):
    for rank, message in enumerate(pool.run(_all_to_all_pull_mismatch)):
        assert "rank 1 expects 5 elements from rank 0, which sends it 4" in message, (rank, message)
