"""bf16 model through parallelize with TP: which dtypes do the stage's parameters end with?
And per-step norm diff of dp3 zero3 vs one process."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(1, '/work/shared/reviews/parallel')
import torch
import probes
from pycomm.testing import RankPool


def dtypes(dp, tp, pp):
    from parallel.mesh import ParallelMesh
    from parallel.models import GPT, GPTConfig
    from parallel.parallelize import ParallelConfig, parallelize
    torch.manual_seed(0)
    m = GPT(GPTConfig(**probes.BASE)).to(torch.bfloat16)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    try:
        e = parallelize(m, mesh, ParallelConfig(microbatches=2 if pp > 1 else 1))
    except Exception as exc:
        from parallel.tensor.apply import parallelize_block
        from parallel.models import Block
        b = m.blocks[0]
        pass
        mesh.destroy()
        return f"{exc}", {n: str(p.dtype) for n, p in b.named_parameters()}
    out = {}
    for p in e.parameters():
        out.setdefault(str(p.dtype), []).append(e.names.of(p))
    r = e.train_step(*probes.batch(GPTConfig(**probes.BASE), 0, 8))
    mesh.destroy()
    return {k: (len(v), v[:3]) for k, v in out.items()}, r.loss


def main():
    with RankPool(4, backend="pycomm", pg_timeout_s=60) as pool:
        for lay in ((2, 2, 1),):
            print(lay, pool.run(dtypes, *lay)[0], flush=True)
    ref = probes.one_process({}, 20, rows=6)
    with RankPool(3, backend="pycomm", pg_timeout_s=60) as pool:
        for z in (0, 1, 2, 3):
            got = pool.run(probes.layout, 3, 1, 1, {"zero": z}, {}, 20, 6)[0]
            d = [abs(a[1] / b[1] - 1) for a, b in zip(got, ref)]
            worst = max(range(20), key=lambda i: d[i])
            print(f"dp3 zero{z}: worst norm rel {d[worst]:.1e} at step {worst+1} "
                  f"(eng {got[worst][1]:.7f} ref {ref[worst][1]:.7f}); loss rel "
                  f"{max(abs(a[0]/b[0]-1) for a, b in zip(got, ref)):.1e}", flush=True)


if __name__ == "__main__":
    main()
