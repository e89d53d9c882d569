"""The ranks of tests/test_hot_path_syscalls.py: every fast path run N times, under strace.

``python tests/_hot_path_ranks.py INIT_FILE N`` starts 2 ranks (spawned, so strace -f
follows them) that each make a pycomm group, warm every path once, then run each path
N times. The test compares the system calls of two runs with different N.
"""

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def paths(group: dist.ProcessGroup) -> list:
    """One call per path worth guarding: the inline direct op, the ring after the
    zero-copy negotiation, zero-copy on arena tensors, the other collectives."""
    import pycomm

    small, mid = torch.ones(256), torch.ones(16384)  # 1 KB (direct), 64 KB (ring)
    arena = pycomm.empty(16384)
    arena.fill_(1)
    gathered = torch.empty(16384 * WORLD)
    scattered = torch.empty(16384 // WORLD)
    a2a_in, a2a_out = torch.ones(16384), torch.empty(16384)
    return [
        lambda: dist.all_reduce(small, group=group),
        lambda: pycomm.all_reduce_(small, group=group),
        lambda: dist.all_reduce(mid, group=group),
        lambda: dist.all_reduce(arena, group=group),
        lambda: dist.all_gather_into_tensor(gathered, mid, group=group),
        lambda: dist.reduce_scatter_tensor(scattered, mid, group=group),
        lambda: dist.broadcast(mid, src=0, group=group),
        lambda: dist.all_to_all_single(a2a_out, a2a_in, group=group),
    ]


def rank(r: int, init_file: str, n: int) -> None:
    import pycomm  # noqa: F401  registers the backend

    dist.init_process_group("pycomm", init_method=f"file://{init_file}", rank=r,
                            world_size=WORLD)
    calls = paths(dist.group.WORLD)
    for call in calls:  # first calls may map, allocate and log: not counted per op
        call()
    for _ in range(n):
        for call in calls:
            call()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD,
                       start_method="spawn")
