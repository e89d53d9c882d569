"""What each rank runs for tests/test_zero_optimizer.py (one spawn per world size), and
the single-process references they are compared with: ZeroOptimizer as a
``torch.optim.Optimizer`` (param groups, LR schedulers, state_dict, zero_grad, hooks)
and weights loaded into the model behind its back."""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.distributed as dist
from _dp_scenarios import batch, model
from _errors import error_message
from _zero_scenarios import PERSIST_BELOW, full_params
from torch import nn

from pycomm.parallel.models import lm_loss
from pycomm.parallel.zero import ZeroOptimizer, shard_model

STAGES = (1, 2, 3)
CAP_MB = 24 / 1024  # float64: 10 buckets, the first holding both groups
LR, REST_LR = 1e-2, 3e-3
ADAMW = {"lr": LR, "betas": (0.9, 0.95)}


def grouped(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """The GPT recipe: weight decay on matrices only, and here a lower LR for the rest."""
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0,
             "lr": REST_LR}]


def warmup_cosine(step: int) -> float:
    """LambdaLR factor: 3 steps of linear warmup, then a cosine to 0 over 5 steps."""
    return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * (step - 3) / 5))


def roundtrip(obj: Any) -> Any:
    """Through torch.save, as a checkpoint file would (no tensor shared with ``obj``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# -- building and training ------------------------------------------------------------------


def build(group: Any, stage: int, dtype: torch.dtype = torch.float64, seed: int = 0,
          groups: bool = True, mixed: torch.dtype | None = None, cap_mb: float = CAP_MB,
          persist_below: int = 0) -> tuple[nn.Module, ZeroOptimizer]:
    """The test model in ``dtype`` and a ZeroOptimizer over it (stage 3: every parameter
    sharded, by default in units mixing groups; the groups are given as the original
    parameters)."""
    net = model(seed=seed).to(dtype)
    params: Any = grouped(list(net.named_parameters())) if groups else None
    if stage == 3:
        net = shard_model(net, group, persistence_threshold=persist_below)
    opt = ZeroOptimizer(params or net.parameters(), torch.optim.AdamW, stage=stage,
                        process_group=group, bucket_cap_mb=cap_mb, mixed_precision=mixed,
                        **ADAMW)
    return net, opt


def one_step(net: nn.Module, opt: Any, group: Any, step: int, set_to_none: bool = True) -> float:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    opt.zero_grad(set_to_none)
    x, y = batch(step, world, rank)
    logits = net(x)
    loss = lm_loss(logits.to(torch.promote_types(logits.dtype, torch.float32)), y)
    loss.backward()
    opt.step()
    return loss.item()


def train(net: nn.Module, opt: Any, group: Any, steps: range, sched: Any = None,
          set_to_none: bool = True) -> list[float]:
    losses = []
    for step in steps:
        losses.append(one_step(net, opt, group, step, set_to_none))
        if sched is not None:
            sched.step()
    return losses


def reference(world: int, steps: int, schedule: bool) -> dict[str, Any]:
    """torch's AdamW in one process, float64, the same groups, the concatenated batches."""
    net = model().double()
    opt = torch.optim.AdamW(grouped(list(net.named_parameters())), **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine) if schedule else None
    lrs = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, world)
        lm_loss(net(x), y).backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "lrs": lrs}


# -- scenarios --------------------------------------------------------------------------------


def param_groups_case(group: Any, stage: int, schedule: bool, steps: int = 6) -> dict[str, Any]:
    """Param groups (and a LambdaLR over them), float64; the LR the inner optimizer
    really stepped with, seen by a step post-hook."""
    net, opt = build(group, stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine) if schedule else None
    lrs: list[list[float]] = []
    opt.register_step_pre_hook(
        lambda o, _a, _k: lrs.append([g["lr"] for g in o.param_groups]))
    used: list[list[float]] = []
    opt.register_step_post_hook(
        lambda o, _a, _k: used.append([g["lr"] for g in o.optimizer.param_groups]))
    train(net, opt, group, range(steps), sched)
    mixing = [b for b in opt.layout.buckets
              if len({g for g, ids in enumerate(opt.group_params) for i in b.params
                      if i in ids}) > 1]
    return {"params": full_params(net), "lrs": lrs, "used": used,
            "pieces": len(opt.pieces), "shards": len(opt.shard_params),
            "mixing_buckets": len(mixing)}


def _save(net: nn.Module, opt: ZeroOptimizer) -> dict[str, Any]:
    return roundtrip({"model": net.state_dict(), "opt": opt.state_dict()})


def resume_case(group: Any, stage: int, mixed: torch.dtype | None,
                optimizer_first: bool) -> dict[str, Any]:
    """3 steps, save, 3 more; a fresh model and optimizer load the save (optimizer
    first or model first) and take the same 3 steps. A changed group LR must survive."""
    net, opt = build(group, stage, torch.float32, mixed=mixed)
    train(net, opt, group, range(3))
    opt.param_groups[1]["lr"] = 2e-3
    saved = _save(net, opt)
    rest = train(net, opt, group, range(3, 6))
    fresh, fresh_opt = build(group, stage, torch.float32, seed=7, mixed=mixed)
    train(fresh, fresh_opt, group, range(1))  # state of its own, to be replaced
    if optimizer_first:
        fresh_opt.load_state_dict(saved["opt"])
        fresh.load_state_dict(saved["model"])
    else:
        fresh.load_state_dict(saved["model"])
        fresh_opt.load_state_dict(saved["opt"])
    resumed = train(fresh, fresh_opt, group, range(3, 6))
    return {"rest": rest, "resumed": resumed, "params": full_params(net),
            "resumed_params": full_params(fresh), "lr": fresh_opt.param_groups[1]["lr"]}


def load_errors(group: Any) -> dict[str, str]:
    """What load_state_dict says to a state it cannot take."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _, opt = build(group, 1, torch.float32)
    good = opt.state_dict()

    def load(into: Any, **changes: Any) -> str:
        return error_message(lambda: into.load_state_dict({**good, **changes}))

    return {
        "stage": load(build(group, 2, torch.float32)[1]),
        "world": load(opt, world=world + 1),
        "rank": load(opt, rank=(rank + 1) % world),
        "buckets": load(build(group, 1, torch.float32, cap_mb=64 / 1024)[1]),
        "precision": load(build(group, 1, torch.float32, mixed=torch.bfloat16)[1]),
        "groups": load(_one_group(group)),
        "plain": error_message(lambda: opt.load_state_dict(
            torch.optim.AdamW(model().parameters()).state_dict())),
        "add_group": error_message(lambda: opt.add_param_group({"params": []}),
                                   (RuntimeError,)),
    }


def _one_group(group: Any) -> ZeroOptimizer:
    """The grouped parameters in the same order (the same layout), as one group."""
    net = model().float()
    params = [p for g in grouped(list(net.named_parameters())) for p in g["params"]]
    return ZeroOptimizer(params, torch.optim.AdamW, stage=1, process_group=group,
                         bucket_cap_mb=CAP_MB, **ADAMW)


def undone_case(group: Any, stage: int, mixed: torch.dtype | None) -> dict[str, Any]:
    """Weights of another model loaded into one trained and evaluated: the next forward
    sees them (stage 3: no stale gathered copy, of the persistent unit either), and a
    step with LR 0 keeps them (stages 1-2: the old masters are not copied back)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kwargs = {"groups": False, "mixed": mixed, "persist_below": PERSIST_BELOW}
    net, opt = build(group, stage, torch.float32, seed=1, **kwargs)
    train(net, opt, group, range(2))
    x, _ = batch(9, world, rank)
    with torch.no_grad():
        net(x)  # evaluation: stage 3 keeps the persistent unit gathered until a step
    source, _ = build(group, stage, torch.float32, seed=5, **kwargs)
    net.load_state_dict(roundtrip(source.state_dict()))
    with torch.no_grad():
        same_forward = torch.equal(net(x), source(x))
    for g in opt.param_groups:
        g["lr"] = 0.0
    one_step(net, opt, group, 2)
    kept = all(torch.equal(a, b) for a, b in zip(full_params(net), full_params(source),
                                                 strict=True))
    return {"same_forward": same_forward, "kept": kept}


def loaded_trajectory(group: Any, stage: int, mixed: torch.dtype | None,
                      assign: bool = False) -> dict[str, Any]:
    """A fresh optimizer whose model then loads weights W trains exactly as one built on
    a model holding W (stage 3: W is another sharded model's; ``assign``: by replacing
    its shards). Under mixed precision W is representable in the compute dtype, so both
    have the same masters."""
    net, opt = build(group, stage, torch.float32, seed=1, groups=False, mixed=mixed)
    if stage == 3:
        source, source_opt = build(group, 3, torch.float32, seed=5, groups=False, mixed=mixed)
        weights = roundtrip(source.state_dict())
    else:
        source = model(seed=5)
        weights = {k: v.to(mixed or v.dtype).float() for k, v in source.state_dict().items()}
        source.load_state_dict(weights)
        source_opt = ZeroOptimizer(source.parameters(), torch.optim.AdamW, stage=stage,
                                   process_group=group, bucket_cap_mb=CAP_MB,
                                   mixed_precision=mixed, **ADAMW)
    net.load_state_dict(weights, assign=assign)
    mine = train(net, opt, group, range(3))
    theirs = train(source, source_opt, group, range(3))
    same = all(torch.equal(a, b) for a, b in zip(full_params(net), full_params(source),
                                                 strict=True))
    return {"same_losses": mine == theirs, "same_params": same}


def new_data_case(group: Any) -> dict[str, Any]:
    """``p.data = t`` (same shape and dtype) is taken into the buffer at the next step;
    another dtype is refused there."""
    net, opt = build(group, 1, torch.float32, groups=False)
    first = next(net.parameters())
    with torch.no_grad():
        first.data = torch.full_like(first, 0.5)
    for g in opt.param_groups:
        g["lr"] = 0.0
    one_step(net, opt, group, 0)
    taken = bool((full_params(net)[0] == 0.5).all())
    first.data = first.detach().double()
    return {"taken": taken, "dtype_error": error_message(lambda: opt.step())}


def _grads(net: nn.Module, opt: ZeroOptimizer) -> list[torch.Tensor | None]:
    """Every ``.grad`` there is: the model's parameters' (stage 3: shards), the
    optimizer's (stage 3: the original parameters) and its pieces' (set by the step)."""
    return [p.grad for p in [*net.parameters(), *opt.params, *opt.piece_params]]


def api_case(group: Any, stage: int) -> dict[str, Any]:
    """isinstance, zero_grad's two modes, step hooks, a closure, and a group's LR."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net, opt = build(group, stage, torch.float32, groups=False)
    calls: list[tuple[str, int]] = []
    opt.register_step_pre_hook(lambda o, _a, _k: calls.append(("pre", _steps(o))))
    opt.register_step_post_hook(lambda o, _a, _k: calls.append(("post", _steps(o))))
    x, y = batch(0, world, rank)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = lm_loss(net(x), y)
        loss.backward()
        return loss

    returned = opt.step(closure)
    had_grads = any(g is not None for g in _grads(net, opt))
    opt.zero_grad()
    none_after = all(g is None for g in _grads(net, opt))
    grads = [torch.ones_like(p) for p in net.parameters()]
    for p, g in zip(net.parameters(), grads, strict=True):
        p.grad = g
    opt.zero_grad(set_to_none=False)
    zeroed = all(p.grad is g and not g.any() for p, g in zip(net.parameters(), grads,
                                                             strict=True))
    return {"optimizer": isinstance(opt, torch.optim.Optimizer), "calls": calls,
            "closure_loss": returned.item(), "had_grads": had_grads,
            "none_after": none_after, "zeroed_in_place": zeroed,
            "accumulate": _zero_grad_modes_agree(group, stage),
            "lr_change": _lr_change(group, stage)}


def _steps(opt: ZeroOptimizer) -> int:
    """The inner optimizer's step count (0 before its first step)."""
    state = opt.optimizer.state.get(opt.piece_params[0], {})
    return int(state["step"]) if "step" in state else 0


def _zero_grad_modes_agree(group: Any, stage: int) -> bool:
    """Three steps after zero_grad(set_to_none=False) equal three after zero_grad():
    neither lets a step's reduced gradient leak into the next."""
    runs = []
    for set_to_none in (True, False):
        net, opt = build(group, stage, torch.float32, groups=False)
        train(net, opt, group, range(3), set_to_none=set_to_none)
        runs.append(full_params(net))
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _lr_change(group: Any, stage: int) -> dict[str, bool]:
    """param_groups[0]["lr"] = 0 freezes group 0 (the matrices) at the next step."""
    net, opt = build(group, stage, torch.float32)
    train(net, opt, group, range(1))
    before = full_params(net)
    opt.param_groups[0]["lr"] = 0.0
    train(net, opt, group, range(1, 2))
    after = full_params(net)
    matrix = [p.dim() >= 2 for p in model().parameters()]
    return {"frozen": all(torch.equal(a, b) for a, b, m in zip(before, after, matrix,
                                                                strict=True) if m),
            "others_moved": all(not torch.equal(a, b) for a, b, m in
                                zip(before, after, matrix, strict=True) if not m)}


def reduce_later_case(group: Any) -> dict[str, Any]:
    """Stage 1: two micro-batches under no_sync, then every bucket reduced at once
    outside backward (what a deferred mode does), float64; and the reference."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net, opt = build(group, 1)
    opt.zero_grad()
    with opt.no_sync():
        for micro in range(2):
            x, y = batch(micro, world, rank)
            (lm_loss(net(x), y) / 2).backward()
    opt._shards.reduce_gradients()
    opt.step()
    return {"params": full_params(net)}


def reduce_later_reference(world: int) -> list[torch.Tensor]:
    net = model().double()
    opt = torch.optim.AdamW(grouped(list(net.named_parameters())), **ADAMW)
    for micro in range(2):
        x, y = batch(micro, world)
        (lm_loss(net(x), y) / 2).backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def run_all(world: int) -> dict[Any, Any]:
    """Every case, on the pycomm default group."""
    group = dist.group.WORLD
    out: dict[Any, Any] = {}
    for stage in STAGES:
        out[("groups", stage)] = param_groups_case(group, stage, schedule=False)
        out[("schedule", stage)] = param_groups_case(group, stage, schedule=True, steps=8)
        out[("api", stage)] = api_case(group, stage)
        for mixed in (None, torch.bfloat16):
            orders = (False, True) if mixed and stage != 3 else (False,)
            for first in orders:
                out[("resume", stage, mixed, first)] = resume_case(group, stage, mixed, first)
            out[("undone", stage, mixed)] = undone_case(group, stage, mixed)
            out[("loaded", stage, mixed)] = loaded_trajectory(group, stage, mixed)
    for mixed in (None, torch.bfloat16):
        out[("loaded_assign", mixed)] = loaded_trajectory(group, 3, mixed, assign=True)
    out["load_errors"] = load_errors(group)
    out["new_data"] = new_data_case(group)
    out["reduce_later"] = reduce_later_case(group)
    return out
