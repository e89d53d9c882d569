"""What the workers run in pathways' benchmarks: the dispatch benchmark's step (one
definition for both sides: a compute of adjustable length, then an all-reduce over the
mesh; bench.pathways), and the functions of the evidence's programs
(bench._pathways_programs: an all-reduce, a spin, the project's GPT in pipeline stages).

The compute is ``sleep`` by default: on an accelerator the host is free while the
device computes, and a sleeping rank leaves the 2-core host free just so; ``spin`` keeps
the core busy instead (a CPU-bound compute, which here competes with the controller).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.parallel.models.gpt import GPT, GPTConfig, lm_loss


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


# --- the programs of bench.pathways_programs (and of tests/test_pathways.py) ---------


def summed(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of ``x`` over the whole mesh."""
    x = x.clone()
    dist.all_reduce(x, group=ctx.group())
    return x


def spin(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Busy for ``seconds`` (a compute of adjustable length), then an all-reduce."""
    compute(seconds, "spin")
    return summed(ctx, x)


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
