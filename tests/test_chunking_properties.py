"""Property tests of the ring's chunking: for any element count, slot size and slot
count, ring all-reduce, reduce-scatter, all-gather and the broadcast chain give the
reference result. Each example builds a fresh group whose PYCOMM_* settings come from
hypothesis, so chunk boundaries land everywhere (the gloo trick of a test-only
maxSegmentSize, done through the environment)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

WORLD = 3


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, backend="pycomm", pg_timeout_s=30) as p:
        yield p


def _ring_ops(count: int, chunk_bytes: int, slots: int) -> list[str]:
    """Runs the ring algorithms in a group with the given settings; returns failures."""
    os.environ.update(
        PYCOMM_CHUNK_BYTES=str(chunk_bytes), PYCOMM_SLOTS=str(slots), PYCOMM_ALGO="ring"
    )
    group = dist.new_group(backend="pycomm")
    for key in ("PYCOMM_CHUNK_BYTES", "PYCOMM_SLOTS", "PYCOMM_ALGO"):
        del os.environ[key]
    rank, n = dist.get_rank(), dist.get_world_size()
    base = torch.arange(count * n, dtype=torch.float64)
    problems = []

    total = base[:count] * sum(range(1, n + 1))
    x = base[:count] * (rank + 1)
    dist.all_reduce(x, group=group)
    if not torch.equal(x, total):
        problems.append("all_reduce")

    # AVG scales the final value once, in the step that also copies it on (one pass).
    x = base[:count] * (rank + 1)
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
    if not torch.equal(x, total * (1.0 / n)):
        problems.append("all_reduce AVG")

    out = torch.empty(count, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, base * (rank + 1), group=group)
    if not torch.equal(out, base[rank * count : (rank + 1) * count] * sum(range(1, n + 1))):
        problems.append("reduce_scatter")

    gathered = torch.empty(count * n, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, base[:count] + rank, group=group)
    expected = torch.cat([base[:count] + r for r in range(n)])
    if not torch.equal(gathered, expected):
        problems.append("all_gather")

    # A copy along the ring keeps every bit: signalling NaNs with payloads, in float32
    # and bfloat16 (no round trip through a wider float may quiet them).
    for dtype, bits_dtype, nan in ((torch.float32, torch.int32, 0x7F800001),
                                   (torch.bfloat16, torch.int16, 0x7F81)):
        payload = torch.arange(count, dtype=torch.int64) % 31 + 8 * rank
        mine = (nan + payload).to(bits_dtype)
        gathered = torch.empty(count * n, dtype=dtype)
        dist.all_gather_into_tensor(gathered, mine.view(dtype), group=group)
        expected = torch.cat([(nan + torch.arange(count) % 31 + 8 * r).to(bits_dtype)
                              for r in range(n)])
        if not torch.equal(gathered.view(bits_dtype), expected):
            problems.append(f"all_gather {dtype} bits")

    b = base[:count] if rank == 1 else torch.zeros(count, dtype=torch.float64)
    dist.broadcast(b, 1, group=group)
    if not torch.equal(b, base[:count]):
        problems.append("broadcast")
    dist.destroy_process_group(group)
    return problems


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(min_value=0, max_value=20_000),
    # 12296 and 65536 hold pieces longer than the kernels' 512-element blocks.
    chunk_bytes=st.sampled_from([64, 128, 192, 1024, 4096, 12296, 65536]),
    slots=st.integers(min_value=2, max_value=5),
)
def test_ring_chunking_any_boundaries(pool, count, chunk_bytes, slots):
    results = pool.run(_ring_ops, count, chunk_bytes, slots)
    assert results == [[]] * WORLD, f"count={count} chunk={chunk_bytes} slots={slots}: {results}"
