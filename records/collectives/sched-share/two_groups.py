# One all_reduce against the same bytes split over two pycomm groups (two worker threads
# per rank), under K competing processes per CPU: python two_groups.py K cpu MB

import os, statistics, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, "/work/main")
from pycomm.testing import run_ranks
from bench._load import competing

def body(nbytes, iters, lanes):
    t = torch.ones(nbytes // 4)
    groups = [dist.new_group(backend="pycomm") for _ in range(lanes)] if lanes > 1 else None
    def op():
        if lanes == 1:
            dist.all_reduce(t)
            return
        works = [dist.all_reduce(part, group=g, async_op=True)
                 for part, g in zip(t.chunk(lanes), groups)]
        for w in works:
            w.wait()
    for _ in range(2):
        op()
    walls = []
    for _ in range(iters):
        dist.barrier()
        w0 = time.perf_counter(); op(); walls.append((time.perf_counter() - w0) * 1e3)
    return f"{statistics.median(walls):6.1f}"

if __name__ == "__main__":
    k, kind, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) << 20
    with competing(k, kind):
        time.sleep(1)
        for rep in range(2):
            for lanes in (1, 2):
                res = run_ranks(body, 2, size, 9, lanes, backend="pycomm")
                print(f"k={k} {kind} lanes={lanes} rep{rep}: " + " ".join(res), flush=True)
