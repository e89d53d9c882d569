"""ZeRO-3 at dp=4: bytes each rank materializes for engine.save (dp.local_state), vs its steady
sharded state; and whether parallelize accepts a meta-device (deferred-init) model."""
import gc
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import mem_probe
from pycomm.testing import RankPool

MB = 1e6


def nbytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def save_cost(zero, path):
    from parallel.mesh import ParallelMesh
    from parallel.models import GPT, GPTConfig
    from parallel.parallelize import ParallelConfig, parallelize
    import parallel.checkpoint as ck
    torch.set_num_threads(1)
    cfg = GPTConfig(**mem_probe.MODEL)
    mesh = ParallelMesh(dp=dist.get_world_size())
    torch.manual_seed(0)
    e = parallelize(GPT(cfg), mesh, ParallelConfig(zero=zero, bucket_mb=1))
    x = torch.randint(0, 256, (4 * mesh.size("dp"), 128))
    e.train_step(x, x)
    gc.collect()
    steady = mem_probe.tensor_bytes(e)[0]
    sys.path.insert(0, "/work/main")
    from bench._memory_probe import PeakSampler
    with PeakSampler() as s:
        e.save(path, {"step": 1})
    mesh.destroy()
    return steady, s.peak - s.start


def meta_init():
    from parallel.mesh import ParallelMesh
    from parallel.models import GPT, GPTConfig
    from parallel.parallelize import ParallelConfig, parallelize
    mesh = ParallelMesh(dp=dist.get_world_size())
    try:
        with torch.device("meta"):
            m = GPT(GPTConfig(**mem_probe.MODEL))
        e = parallelize(m, mesh, ParallelConfig(zero=3))
        x = torch.randint(0, 256, (4 * mesh.size("dp"), 128))
        r = e.train_step(x, x)
        return f"ran: loss {r.loss}"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        mesh.destroy()


def main():
    with RankPool(4, backend="pycomm", pg_timeout_s=120) as pool:
        for z in (0, 3):
            res = pool.run(save_cost, z, f"savemem_z{z}", timeout_s=400)
            print(f"dp=4 zero={z}: per-rank steady tensors {[round(a/MB,1) for a,_ in res]} MB; "
                  f"peak bytes in use added by the save (malloc + shm) {[round(b/MB,1) for _,b in res]} MB", flush=True)
        print("meta-device model + zero3:", pool.run(meta_init)[0], flush=True)


if __name__ == "__main__":
    main()
