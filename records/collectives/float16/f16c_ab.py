# float16 all_reduce (dist.all_reduce, ordinary tensors, ranks pinned r % CPUs, 1 thread):
# the F16C conversions against the portable ones, one build, one process group,
# interleaved 5 rounds (pycomm._C._allow_f16c). Usage: python f16c_ab.py WORLD
import os, sys, time, statistics
import torch, torch.multiprocessing as mp, torch.distributed as dist

def rank_main(rank, world, port):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pycomm
    from pycomm import _C
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    out = {}
    for rnd in range(5):
        for way in (True, False):
            _C._allow_f16c(way)
            for nbytes in (64 << 10, 1 << 20, 16 << 20):
                x = torch.rand(nbytes // 2).half()
                for _ in range(3): dist.all_reduce(x)
                iters = 50 if nbytes <= 1 << 20 else 10
                dist.barrier(); t = time.perf_counter()
                for _ in range(iters): dist.all_reduce(x)
                out.setdefault((nbytes, way), []).append((time.perf_counter() - t) / iters * 1e6)
    if rank == 0:
        for nbytes in (64 << 10, 1 << 20, 16 << 20):
            a, b = out[(nbytes, True)], out[(nbytes, False)]
            print(f"{nbytes>>10:6d} KB  F16C {statistics.median(a):8.1f} us ({min(a):.1f}-{max(a):.1f})  portable {statistics.median(b):8.1f} ({min(b):.1f}-{max(b):.1f})  portable/F16C {statistics.median(b)/statistics.median(a):.2f}")
    dist.destroy_process_group()

if __name__ == "__main__":
    w = int(sys.argv[1])
    mp.spawn(rank_main, args=(w, 29811 + w), nprocs=w)
