"""One model of the zoo trained in one layout (on the ranks of a pool), and the one
process every layout must reproduce: the same weights, batches, AdamW (decay on
matrices), learning-rate schedule and clipping, and the same precision recipe."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.nn.functional as F

from bench import _model_zoo as zoo
from pycomm.parallel.checkpointing.optim_groups import param_groups

Curve = list[tuple[float, float, bool]]  # (loss, grad norm, step skipped) per step
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _logits(plan: Any, output: Any) -> torch.Tensor:
    return plan.output(output) if plan.output is not None else output


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def one_process(name: str, recipe: zoo.Recipe, precision: str = "fp32",
                meta: bool = False, loss_scale: float = 2.0**16) -> Curve:
    """The reference run (see the module docstring). Under bf16/fp16 the model computes
    in that dtype and AdamW steps fp32 masters; fp16 scales the loss as the engine does."""
    from pycomm.parallel.compose.loss_scale import LossScaler
    from pycomm.parallel.compose.materialize import materialize
    from pycomm.parallel.compose.parallelize import plan_for

    model = _built(name, meta)
    plan = zoo.plan_of(name, model) or plan_for(model)
    if meta:
        materialize(model, seed=0, init=plan.init, experts=plan.experts)
    params = list(dict.fromkeys(model.parameters()))
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    if precision in _LOW:
        model.to(_LOW[precision])
    opt = torch.optim.AdamW(param_groups(masters, recipe.weight_decay), lr=recipe.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, recipe.lr_lambda())
    scaler = LossScaler(loss_scale, 1000) if precision == "fp16" else None
    return [_reference_step(name, step, model, plan, params, masters, opt, sched, scaler,
                            recipe) for step in range(recipe.steps)]


def _reference_step(name: str, step: int, model: Any, plan: Any, params: list[Any],
                    masters: list[Any], opt: Any, sched: Any, scaler: Any,
                    recipe: zoo.Recipe) -> tuple[float, float, bool]:
    x, y = zoo.batch(name, step)
    if x.is_floating_point():
        x = x.to(params[0].dtype)
    model.zero_grad(set_to_none=True)
    loss = _loss(_logits(plan, model(x)), y)
    (loss * (scaler.scale if scaler else 1.0)).backward()
    for p, m in zip(params, masters, strict=True):
        m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
    if scaler is not None:
        parts = [(m.grad, 1.0) for m in masters]
        if not all(bool(torch.isfinite(g).all()) for g, _ in parts):
            scaler.update(True)
            return float(loss.detach()), float("inf"), True
        scaler.unscale(parts)
    norm = float(torch.nn.utils.clip_grad_norm_(masters, recipe.clip))
    opt.step()
    sched.step()
    if scaler is not None:
        scaler.update(False)
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)
    return float(loss.detach()), norm, False


def _built(name: str, meta: bool) -> Any:
    if not meta:
        return zoo.build(name)
    with torch.device("meta"):
        return zoo.build(name)


def layout(name: str, dp: int, tp: int, pp: int, config: dict[str, Any],
           recipe: zoo.Recipe, meta: bool = False) -> Curve | str:
    """The engine on a (dp, tp, pp) mesh of this pool's world: its curve, or the error
    (as text: a layout the engine refuses is a row of the table, not a crash)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = None
    try:
        model = _built(name, meta)
        mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
        settings = {"microbatches": 2 if pp > 1 else 1, "max_grad_norm": recipe.clip,
                    "weight_decay": recipe.weight_decay, "lr_lambda": recipe.lr_lambda(),
                    "optimizer_kwargs": {"lr": recipe.lr}, **config}
        engine = parallelize(model, mesh, ParallelConfig(**settings), zoo.plan_of(name, model))
        out = []
        for step in range(recipe.steps):
            r = engine.train_step(*zoo.batch(name, step))
            out.append((r.loss, r.grad_norm, r.skipped))
        return out
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:600] + "\n" + traceback.format_exc()[-1500:]
    finally:
        if mesh is not None:
            mesh.destroy()


def relative(got: Curve | str, want: Curve) -> tuple[float, float] | str:
    """The largest relative difference of the losses and of the gradient norms (steps
    neither skipped), or the error text."""
    if isinstance(got, str):
        return got
    pairs = [(a, b) for a, b in zip(got, want, strict=True) if not a[2] and not b[2]]
    loss = max(abs(a[0] / b[0] - 1) for a, b in zip(got, want, strict=True))
    norm = max((abs(a[1] / b[1] - 1) for a, b in pairs), default=0.0)
    return loss, norm
