"""What both data-parallel sides share: the optimizer's parameter groups, and optimizer
state made before a checkpoint is loaded into it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors (biases, norms) do not: the usual GPT recipe."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


@torch.no_grad()
def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a fresh ``optimizer`` its state tensors (Adam's moments),
    so a checkpoint can be read into them in place: one step with zero gradients at
    learning rate 0 (weight decay scales by it too), as torch's own
    ``torch.distributed.checkpoint.state_dict`` does. The values are then overwritten."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
