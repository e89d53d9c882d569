"""The composed engine against one process: the same GPT, batches, optimizer, LR schedule
and clipping, a few steps; the losses and gradient norms of every step compared."""

from __future__ import annotations

from typing import Any

import torch

from pycomm.parallel.checkpointing.optim_groups import param_groups
from pycomm.parallel.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0)
BATCH, STEPS, CLIP, DECAY = 8, 3, 0.5, 0.1


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def one_process(steps: int = STEPS) -> list[tuple[float, float]]:
    """Plain PyTorch: the curve every layout must reproduce."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(param_groups(list(model.parameters()), DECAY), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        out.append((loss.item(), norm.item()))
    return out


def layout(dp: int, tp: int, pp: int, config: dict[str, Any]) -> list[tuple[float, float]]:
    """The engine on a (dp, tp, pp) mesh of this pool's world."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    config = {"microbatches": 2 if pp > 1 else 1, **config}
    engine = parallelize(model, mesh, ParallelConfig(
        **{"max_grad_norm": CLIP, "weight_decay": DECAY, "lr_lambda": lr_lambda, **config}))
    out = []
    for step in range(STEPS):
        r = engine.train_step(*batch(step))
        out.append((r.loss, r.grad_norm))
    mesh.destroy()
    return out


def recompute_gradients(dp: int, tp: int, pp: int, sequence_parallel: bool) -> float:
    """With dropout, this layout's gradients recomputing every block and not: the largest
    difference (0.0 when every random stream is replayed exactly)."""
    from dataclasses import replace

    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(replace(CFG, dropout=0.1))
        mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
        engine = parallelize(model, mesh, ParallelConfig(
            microbatches=2, recompute=recompute, sequence_parallel=sequence_parallel, seed=7))
        engine.compute_gradients(*batch(0))
        grads.append({engine.names.of(p): p.grad.clone() for p in engine.parameters()})
        mesh.destroy()
    return max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0])


def layout_with_checkpoint(dp: int, tp: int, pp: int, zero: int, path: str,
                           mode: str) -> list[float]:
    """``mode="save"``: STEPS + 1 steps, checkpointing after step 2; ``"load"``: resume
    from that checkpoint and run the steps after it. Returns the losses run."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    torch.manual_seed(0)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    engine = parallelize(GPT(CFG), mesh, ParallelConfig(
        zero=zero, microbatches=2 if pp > 1 else 1, max_grad_norm=CLIP, weight_decay=DECAY,
        lr_lambda=lr_lambda))
    first = engine.load(path)["step"] if mode == "load" else 0
    losses = []
    for step in range(first, STEPS + 1):
        losses.append(engine.train_step(*batch(step)).loss)
        if mode == "save" and step + 1 == 2:
            engine.save(path, {"step": 2})
    mesh.destroy()
    return losses
