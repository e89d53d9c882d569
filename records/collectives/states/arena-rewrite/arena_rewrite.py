# The zero-copy (arena) all_reduce timed as the benchmark's barrier mode times it: each
# call after a barrier, its input rewritten by its own rank first ("rewrite", what
# bench/_timing.py's reset does) or left as the last call wrote it ("as left").
# Interleaved rounds in one process group; ranks pinned round-robin, 1 thread each.
# Usage: python arena_rewrite.py WORLD MIB [ROUNDS]
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, port: int, mib: int, rounds: int) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pycomm

    dist.init_process_group("pycomm", rank=rank, world_size=world)
    n = (mib << 20) // 4
    x = pycomm.empty(n)
    pristine = torch.full((n,), float(rank + 1))
    x.copy_(pristine)
    for _ in range(3):
        dist.all_reduce(x)
    times: dict[str, list[float]] = {"rewrite": [], "as left": []}
    for _ in range(rounds):
        for mode in times:
            per_call = []
            for _ in range(5):
                if mode == "rewrite":
                    x.copy_(pristine)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                per_call.append(time.perf_counter() - start)
            slowest = torch.tensor([statistics.median(per_call)])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[mode].append(slowest.item() * 1e6)
    if rank == 0:
        r, a = times["rewrite"], times["as left"]
        print(f"{world} ranks {mib} MiB: rewrite {statistics.median(r):.0f} us "
              f"({min(r):.0f}-{max(r):.0f}), as left {statistics.median(a):.0f} "
              f"({min(a):.0f}-{max(a):.0f}), rewrite / as left "
              f"{statistics.median(r) / statistics.median(a):.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, mib = int(sys.argv[1]), int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    mp.spawn(rank_main, args=(world, 29900 + world + mib, mib, rounds), nprocs=world)
