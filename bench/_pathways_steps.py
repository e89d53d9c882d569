"""The step of the dispatch benchmark, one definition for both sides: a compute of
adjustable length, then an all-reduce over the mesh (bench.pathways).

The compute is ``sleep`` by default: on an accelerator the host is free while the
device computes, and a sleeping rank leaves the 2-core host free just so; ``spin`` keeps
the core busy instead (a CPU-bound compute, which here competes with the controller).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def compute(seconds: float, kind: str) -> None:
    if seconds <= 0:
        return
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def chain_step(x: torch.Tensor, group: Any, seconds: float, kind: str) -> torch.Tensor:
    """One SPMD function of the chain: compute, then all-reduce (MAX keeps it bounded)."""
    compute(seconds, kind)
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    return y


def pw_step(ctx: Any, x: torch.Tensor, seconds: float, kind: str) -> torch.Tensor:
    """The same step as a function the controller calls on a mesh."""
    return chain_step(x, ctx.group(), seconds, kind)


def pw_noop(ctx: Any, x: Any) -> Any:
    """Nothing at all: what one call costs the dispatch path alone."""
    return x
