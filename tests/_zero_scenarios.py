"""What each rank runs for tests/test_zero.py (one spawn per world size), and the
single-process references they are compared with."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dp_scenarios import batch, model

from parallel.models import lm_loss
from parallel.zero import ZeroOptimizer

STEPS = 20
CLIP = 0.5  # small enough that clipping is active on most steps
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def reference(world: int, optim: str, clip: bool) -> dict[str, Any]:
    """One process on the concatenated batch, torch's optimizer and clipping."""
    net = model()
    cls, kwargs = OPTIMIZERS[optim]
    opt = cls(net.parameters(), **kwargs)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world)
        loss = lm_loss(net(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        losses.append(loss.item())
        opt.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "losses": losses,
            "norms": norms}


def train(group: Any, stage: int, optim: str, clip: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net = model(seed=rank)  # different on purpose: ZeroOptimizer broadcasts rank 0's
    cls, kwargs = OPTIMIZERS[optim]
    opt = ZeroOptimizer(net.parameters(), cls, stage=stage, process_group=group,
                        bucket_cap_mb=16 / 1024, **kwargs)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = lm_loss(net(x), y)
        loss.backward()
        if clip:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
        losses.append(loss.item())
        opt.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "losses": losses,
            "norms": norms, "memory": opt.memory_stats(), "buckets": len(opt.layout.buckets)}


def memory(group: Any, stage: int) -> dict[str, Any]:
    """Measured bytes after one AdamW step, and Psi."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net = model()
    opt = ZeroOptimizer(net.parameters(), torch.optim.AdamW, stage=stage, process_group=group,
                        bucket_cap_mb=16 / 1024, lr=1e-3)
    x, y = batch(0, world, rank)
    lm_loss(net(x), y).backward()
    opt.step()
    return {"psi": sum(p.numel() for p in net.parameters()), **opt.memory_stats()}


def bad_input(group: Any) -> dict[str, str]:
    net = model()
    errors = {}
    for name, call in {
        "stage": lambda: ZeroOptimizer(net.parameters(), torch.optim.SGD, stage=4, lr=0.1),
        "twice": lambda: ZeroOptimizer([*net.parameters(), next(net.parameters())],
                                       torch.optim.SGD, process_group=group, lr=0.1),
    }.items():
        try:
            call()
            errors[name] = ""
        except (ValueError, TypeError) as exc:
            errors[name] = str(exc)
    return errors


def run_all(world: int) -> dict[str, Any]:
    """Every case on the pycomm default group and on a gloo group of the same ranks."""
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out: dict[str, Any] = {}
    for name, group in groups.items():
        for stage in (1, 2):
            out[(name, stage, "sgd")] = train(group, stage, "sgd", clip=False)
            out[(name, stage, "adamw_clip")] = train(group, stage, "adamw", clip=True)
            out[(name, stage, "memory")] = memory(group, stage)
    out["bad_input"] = bad_input(dist.group.WORLD)
    return out
