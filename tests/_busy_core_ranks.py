"""The ranks of tests/test_busy_core_waits.py: 2 ranks, each pinned to its own CPU beside
a busy loop pinned to the same CPU (another job's thread), run N all_reduces of 1 MB.

``python tests/_busy_core_ranks.py INIT_FILE N`` prints the seconds rank 0 spent in the
group, from init_process_group to its last barrier: every wait strace counts (the
rendezvous, the warm-up op and the barriers as well as the N ops) falls in that span.
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
    start = time.perf_counter()
    dist.init_process_group("pycomm", init_method=f"file://{init_file}", rank=r,
                            world_size=WORLD)
    x = torch.ones(1 << 18)
    dist.all_reduce(x)
    dist.barrier()
    for _ in range(n):
        dist.all_reduce(x)
    dist.barrier()
    if r == 0:
        print(f"{time.perf_counter() - start:.3f}", flush=True)
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
