"""The ranks of tests/test_busy_core_waits.py: 2 ranks, each pinned to its own CPU beside
a busy loop pinned to the same CPU (another job's thread), run N all_reduces of 1 MB.

``python tests/_busy_core_ranks.py INIT_FILE N`` prints when (time.time(), the clock
strace -ttt stamps with) rank 0's N ops began, after the group's set-up, its warm-up op
and a barrier, and when they ended: the set-up's own waits (the core probe yields as it
likes) fall outside that span.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def busy(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def rank(r: int, init_file: str, n: int) -> None:
    import pycomm  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {r})
    dist.init_process_group("pycomm", init_method=f"file://{init_file}", rank=r,
                            world_size=WORLD)
    x = torch.ones(1 << 18)
    dist.all_reduce(x)
    dist.barrier()
    start = time.time()
    for _ in range(n):
        dist.all_reduce(x)
    end = time.time()
    dist.barrier()
    if r == 0:
        print(f"{start:.6f} {end:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=busy, args=(cpu,), daemon=True) for cpu in range(WORLD)]
    for h in hogs:
        h.start()
    try:
        mp.start_processes(rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD,
                           start_method="spawn")
    finally:
        for h in hogs:
            h.kill()
            h.join()
