"""A torchrun worker for tests/test_lifecycle.py: env:// init of the pycomm backend, a few
collectives checked against exact references, destroy.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_torchrun_worker.py

Prints one line per rank: "rank R of W: ok <backend class> <checks>" or raises.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import pycomm


def main() -> None:
    dist.init_process_group("pycomm")  # env:// (MASTER_ADDR, RANK, WORLD_SIZE from torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    weights = sum(range(1, world + 1))
    checks = []

    for count in (10, 300_001):  # direct, then ring
        t = torch.arange(count, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(count, dtype=torch.float64) * weights), count
        checks.append(f"all_reduce[{count}]")

    a = pycomm.empty(1 << 20, dtype=torch.float32).fill_(rank + 1)  # zero-copy
    dist.all_reduce(a)
    assert bool((a == weights).all())
    checks.append("all_reduce[arena]")

    mine = torch.full((1000,), rank, dtype=torch.int64)
    out = torch.empty(1000 * world, dtype=torch.int64)
    dist.all_gather_into_tensor(out, mine)
    assert torch.equal(out, torch.arange(world).repeat_interleave(1000))
    checks.append("all_gather")

    b = torch.full((7,), float(rank))
    dist.broadcast(b, src=world - 1)
    assert bool((b == world - 1).all())
    checks.append("broadcast")

    full = torch.arange(world * 5, dtype=torch.int32)
    part = torch.empty(5, dtype=torch.int32)
    dist.reduce_scatter_tensor(part, full)
    assert torch.equal(part, torch.arange(rank * 5, rank * 5 + 5, dtype=torch.int32) * world)
    checks.append("reduce_scatter")

    dist.barrier()
    print(f"rank {rank} of {world}: ok {backend} {','.join(checks)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
