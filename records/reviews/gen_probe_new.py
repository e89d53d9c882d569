"""Generality: parallelize on models other than the reference GPT; tied weights; a custom block."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from torch import nn
import torch.nn.functional as F
import probes
from parallel.models import GPT, GPTConfig, lm_loss
from pycomm.testing import RankPool

CFG = GPTConfig(**probes.BASE)


class MyBlock(nn.Module):
    """A user's own pre-norm block (same maths as the reference one, torch's MultiheadAttention)."""
    def __init__(self, cfg):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


def build(kind):
    torch.manual_seed(0)
    if kind == "sequential":
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
    m = GPT(CFG)
    if kind == "tied":
        m.lm_head.weight = m.embed.wte.weight
    if kind == "myblock":
        torch.manual_seed(1)
        m.blocks = nn.ModuleList(MyBlock(CFG) for _ in range(CFG.n_layer))
    return m


def one(kind, steps=5):
    m = build(kind)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    out = []
    for s in range(steps):
        x, y = probes.batch(CFG, s, 8)
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


def eng(kind, dp, tp, pp, extra, steps=5):
    from parallel.mesh import ParallelMesh
    from parallel.parallelize import ParallelConfig, parallelize
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    try:
        e = parallelize(build(kind), mesh, ParallelConfig(
            microbatches=2 if pp > 1 else 1, max_grad_norm=1.0, **extra))
        out = []
        for s in range(steps):
            r = e.train_step(*probes.batch(CFG, s, 8))
            out.append((r.loss, r.grad_norm))
        info = sorted({type(m).__name__ for m in e.stage.modules()} & {"MyBlock", "Block", "ParallelSelfAttention", "MultiheadAttention"})
        return out, info, sum(p.numel() for p in e.parameters())
    except Exception as exc:
        import traceback
        return f"{type(exc).__name__}: {exc}"[:300] + " @ " + traceback.format_exc().strip().splitlines()[-3].strip()[:120]
    finally:
        mesh.destroy()


def main():
    refs = {k: one(k) for k in ("tied", "myblock")}
    with RankPool(2, backend="pycomm", pg_timeout_s=60) as pool:
        for kind, lay, extra in (("sequential", (2, 1, 1), {}),
                                 ("tied", (2, 1, 1), {}), ("tied", (1, 1, 2), {}),
                                 ("tied", (1, 2, 1), {}), ("tied", (2, 1, 1), {"zero": 3}),
                                 ("myblock", (2, 1, 1), {}), ("myblock", (1, 2, 1), {}),
                                 ("myblock", (1, 2, 1), {"sequential_parallel": True} if False else {"sequence_parallel": True}),
                                 ("myblock", (1, 2, 1), {"recompute": True}),
                                 ("myblock", (2, 1, 1), {"zero": 3})):
            r = pool.run(eng, kind, *lay, extra)[0]
            if isinstance(r, str):
                print(f"{kind:10s} {lay} {extra}: {r}", flush=True)
                continue
            got, info, n = r
            if kind not in refs:
                print(f"{kind:10s} {lay} {extra}: trained {len(got)} steps, losses {[round(l, 4) for l, _ in got]}", flush=True)
                continue
            ref = refs[kind]
            dl = max(abs(a[0] / b[0] - 1) for a, b in zip(got, ref))
            print(f"{kind:10s} {lay} {extra}: max loss rel diff vs 1 proc {dl:.1e} (step5 {got[-1][0]:.5f} vs "
                  f"{ref[-1][0]:.5f}); modules {info}; rank0 params {n}", flush=True)


if __name__ == "__main__":
    main()
