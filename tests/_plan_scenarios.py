"""What the ranks run for tests/test_plans.py: the defects an outside review found with
models ``parallelize`` was not written for (each case returns what the test checks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bench import _model_zoo as zoo


def _plan(kind: str | None, name: str, model: Any) -> Any:
    """A plan by the name a test gives it (plans hold closures: they are made here)."""
    from pycomm.parallel.models.gpt_plan import gpt_plan
    from pycomm.parallel.plans.plan import Plan

    if kind == "zoo":
        return zoo.plan_of(name, model)
    if kind == "gpt_plan":  # the project GPT's, written for another block
        return gpt_plan(model)
    if kind == "whole":  # the whole model as one layer
        return Plan(name=type(model).__name__)
    if kind == "no_blocks":  # the GPT's plan without its blocks
        plan = gpt_plan(model)
        plan.blocks = None
        return plan
    plan = zoo.user_block_plan(model)
    if kind == "no_attention_style":
        del plan.tp["blocks.*.attn"]
    elif kind == "mask_from_input":  # blocks called as block(x): they make their own mask
        plan.layers = ["embed", "blocks.*", "ln_f", "lm_head"]
    return plan


def _engine(name: str, dp: int, tp: int, pp: int, plan: str | None = "zoo",
            meta: bool = False, **config: Any) -> Any:
    """``meta``: the model built on the meta device (each rank makes what it holds)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    with torch.device("meta") if meta else torch.device("cpu"):
        model = zoo.build(name)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    settings = {"microbatches": 2 if pp > 1 else 1, **config}
    chosen = _plan(plan, name, model) if plan else None
    return parallelize(model, mesh, ParallelConfig(**settings), chosen), mesh


def refusal(name: str, dp: int, tp: int, pp: int, plan: str | None = "zoo",
            config: dict[str, Any] | None = None) -> str:
    """The error ``parallelize`` (and the first step) raises, or "" if it trained."""
    mesh = None
    try:
        engine, mesh = _engine(name, dp, tp, pp, plan, **(config or {}))
        engine.train_step(*zoo.batch(name, 0))
        return ""
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if mesh is not None:
            mesh.destroy()


def tie_copies(name: str, dp: int, tp: int, pp: int, steps: int = 3, meta: bool = False
               ) -> dict[str, Any]:
    """After ``steps`` steps: whether the tied embedding and head are one parameter on
    the ranks holding both, the largest difference between the pipeline stages'
    copies (gathered over the pipeline group's ends), and the parameters with memory
    under another stage's modules (none: a tie's owner there was made for its weights
    only)."""
    engine, mesh = _engine(name, dp, tp, pp, meta=meta)
    for step in range(steps):
        engine.train_step(*zoo.batch(name, step))
    tied = [p for p in engine.params if engine.ties.copies(engine.names.of(p)) > 1]
    names = [engine.names.of(p) for p in engine.params]
    one_param = len(names) == len(set(names))
    spread = 0.0
    for p, group in engine.ties.mine(engine.names.by_id(), engine.params):
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        spread = max(spread, max(float((c - copies[0]).abs().max()) for c in copies))
    held = engine.stage_plan.held
    elsewhere = [n for n, p in engine.model.named_parameters(remove_duplicate=False)
                 if not p.is_meta and not any(n.startswith(f"{h}.") for h in held)]
    mesh.destroy()
    return {"cross_stage": len(tied), "one_param": one_param, "spread": spread,
            "held_elsewhere": elsewhere}


def checkpointed_bytes(name: str, recompute: bool) -> int:
    """Bytes the default checkpoint arena holds at the end of the forward (the kept block
    inputs): 0 when nothing is checkpointed."""
    from pycomm.parallel.recompute.checkpoint import default_arena

    engine, mesh = _engine(name, 4, 1, 1, recompute=recompute)
    seen: dict[str, int] = {}
    loss_fn = engine.loss_fn

    def spy(logits: Any, targets: Any) -> Any:
        seen["live"] = default_arena().stats()["live_bytes"]
        return loss_fn(logits, targets)

    engine.loss_fn = spy  # type: ignore[method-assign]
    engine.train_step(*zoo.batch(name, 0))
    mesh.destroy()
    return seen["live"]


def dtypes_after_parallelize(name: str, dp: int, tp: int, pp: int, precision: str,
                             zero: int) -> dict[str, Any]:
    """The dtypes the stage computes in and the optimizer steps, and one step's loss."""
    engine, mesh = _engine(name, dp, tp, pp, precision=precision, zero=zero)
    seen: set[str] = set()
    for layer in engine.stage:  # what every layer computes in (ZeRO-3: gathered copies)
        layer.register_forward_hook(lambda _m, _a, out: seen.add(str(out.dtype)))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's steps masters
    masters = sorted({str(p.dtype) for g in inner.param_groups for p in g["params"]})
    loss = engine.train_step(*zoo.batch(name, 0)).loss
    mesh.destroy()
    return {"compute": sorted(seen), "masters": masters, "loss": loss}
