"""Functions the pathways tests run on workers (importable there: sent by reference)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from bench._pathways_steps import (  # noqa: F401  (the tests' and the benchmarks' own)
    GPT_CFG,
    gpt_layers,
    gpt_loss,
    gpt_stage,
    spin,
    summed,
)
from pycomm.parallel import pathways as pw

F64 = torch.float64


@pw.function(out=pw.spec((8,), F64))
def doubled(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    """A declared function: ``doubled(mesh, x)`` from the controller."""
    return summed(ctx, x)


def rank_value(ctx: Any, base: float, n: int) -> torch.Tensor:
    """Each rank's own float64 values: ``base + position + arange(n) / 7``."""
    return base + ctx.index + torch.arange(n, dtype=F64) / 7


def dim_sum(ctx: Any, x: torch.Tensor, dim: str) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=ctx.group(dim))
    return x


def plus(ctx: Any, x: Any, k: float) -> Any:
    return x + k


def describe(ctx: Any) -> dict[str, Any]:
    return {"island": ctx.island, "rank": dist.get_rank(), "index": ctx.index,
            "coords": ctx.coords, "dm": tuple(ctx.device_mesh.shape)}


def as_object(ctx: Any, x: torch.Tensor) -> dict[str, Any]:
    """An output that is not a tensor (pickled when it moves)."""
    return {"sum": float(x.sum()), "rank": ctx.index, "t": x * 2}


def from_object(ctx: Any, obj: dict[str, Any]) -> float:
    return obj["sum"] + float(obj["t"].sum()) + obj["rank"]


def sleep_then(ctx: Any, x: Any, seconds: float) -> Any:
    time.sleep(seconds)
    return x


def fails(ctx: Any, x: Any) -> Any:
    if ctx.index == 1:
        raise ValueError("rank-one refuses")
    return x


def fails_then_sum(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    """Rank 1 raises; rank 0 goes into the all-reduce and waits there for it."""
    fails(ctx, x)
    return summed(ctx, x)


def wrong_shape(ctx: Any) -> torch.Tensor:
    return torch.zeros(3)




def hangs_on_rank_zero(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Rank 0 hangs ``seconds`` (longer than the cluster's timeout) before the all-reduce
    rank 1 waits in."""
    if ctx.index == 0:
        time.sleep(seconds)
    return summed(ctx, x)
