"""Functions the pathways tests run on workers (importable there: sent by reference)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel import pathways as pw
from parallel.models.gpt import GPT, GPTConfig, lm_loss

F64 = torch.float64


def summed(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of ``x`` over the whole mesh."""
    x = x.clone()
    dist.all_reduce(x, group=ctx.group())
    return x


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


def spin(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Busy for ``seconds`` (a compute of adjustable length), then an all-reduce."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return summed(ctx, x)


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


# --- GPT in two pipeline stages (GPipe over islands) ---------------------------------

GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
SEED = 7


def gpt_layers() -> list[nn.Module]:
    torch.manual_seed(SEED)
    model = GPT(GPT_CFG)
    return [model.embed, *model.blocks, nn.Sequential(model.ln_f, model.lm_head)]


def gpt_stage(stage: int, n_stages: int) -> nn.Module:
    layers = gpt_layers()
    per = -(-len(layers) // n_stages)
    return nn.Sequential(*layers[stage * per:(stage + 1) * per])


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, targets)
