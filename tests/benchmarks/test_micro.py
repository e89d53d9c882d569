"""Micro-benchmarks of the pieces under the collectives (pytest-benchmark), run on demand:

    python -m pytest tests/benchmarks --benchmark-only

They are not part of CI (tests/conftest.py skips this folder unless --benchmark-only is
given): a kernel regression shows here before it shows in bench.collectives' table.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycomm

pytestmark = pytest.mark.usefixtures("require_pycomm")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
ELEMENTS = 1 << 20  # 4 MB of float32: past L2, where the kernels meet memory


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sum_kernel(benchmark, dtype):
    """dst = a + b over 1M elements; bytes moved = 3 x 1M x itemsize."""
    from pycomm import _C

    a = torch.ones(ELEMENTS, dtype=dtype)
    b = torch.ones(ELEMENTS, dtype=dtype)
    dst = torch.empty(ELEMENTS, dtype=dtype)
    benchmark(_C._reduce_into, dst, a, b, "sum")
    assert bool((dst == 2).all())
    benchmark.extra_info["GB/s"] = 3 * ELEMENTS * a.element_size() / benchmark.stats["median"] / 1e9


@pytest.mark.parametrize("ranks", [2, 4])
def test_reduce_copy_kernel(benchmark, ranks):
    """The zero-copy all_reduce's kernel: `ranks` buffers of 1M float32, each reduced
    and written back over all of them in one pass; bytes moved = 2 x ranks x 4 MB."""
    from pycomm import _C

    bufs = [torch.ones(ELEMENTS) for _ in range(ranks)]
    benchmark(_C._reduce_copy, bufs, bufs, "max")  # max keeps the values bounded
    assert all(bool((b == 1).all()) for b in bufs)
    benchmark.extra_info["GB/s"] = 2 * ranks * ELEMENTS * 4 / benchmark.stats["median"] / 1e9


@pytest.mark.parametrize("op", ["max", "prod"])
def test_other_ops_float32(benchmark, op):
    from pycomm import _C

    a, b, dst = (torch.ones(ELEMENTS) for _ in range(3))
    benchmark(_C._reduce_into, dst, a, b, op)


@pytest.mark.parametrize("nbytes", [4096, 1 << 20, 32 << 20])
def test_arena_allocate_and_free(benchmark, nbytes):
    """One pycomm.empty plus its release: the allocator's fixed cost (no first touch)."""
    benchmark(lambda: pycomm.empty(nbytes, dtype=torch.uint8))


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("pycomm", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("nbytes", [8, 4096])
def test_op_fixed_cost(benchmark, one_rank_group, nbytes):
    """dist.all_reduce on one rank: torch's dispatch, pycomm's checks, the inline path
    and the Work, with no peer to wait for — the floor under every op's latency."""
    x = torch.ones(nbytes // 4)
    benchmark(dist.all_reduce, x)
