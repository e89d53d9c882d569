"""Completing a composed job's gradients, in one place and one fixed order.

After every backward of a step has run (all micro-batches of a pipeline), the
gradients of a rank are still partial in up to three ways, and are completed in this
order, as Megatron-LM's ``finalize_model_grads``:

1. **tensor parallel**: with sequence parallelism, parameters applied to a rank's part
   of the sequence (norms, row-parallel biases) hold that part's gradient; the sum over
   the tensor-parallel group is the gradient.
2. **data parallel** (or ZeRO): each replica's gradient is of its own rows; the average
   over the data-parallel group is the gradient (ZeRO keeps this rank's shard of it).
3. **pipeline**: a weight shared by two stages (tied embeddings) sums both stages'
   gradients. Summing is linear, so where the gradients are still whole (plain data
   parallelism, ZeRO 1-2, which reduce here) it runs before the data-parallel
   reduction, on ``.grad``; ZeRO-3 has reduced each unit in backward already, so there
   it sums the tied parameter's gradient shard after (its unit holds it alone, so the
   shards line up across the stages).

No strategy reduces on its own at the end of backward: callbacks queued by separate
strategies would run in whatever order autograd reaches them, and one could take a
gradient away before another sees it.

:func:`clip_grad_norm_` then takes the 2-norm over the whole mesh, counting each
gradient element once: a tensor-parallel shard on every TP rank, a replicated parameter
once; a ZeRO shard on every DP rank, a replicated (averaged) gradient once; every stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..precision import accumulation_dtype, sum_of_squares

# A rank's part of the gradients, as (tensor, weight): the weight is 1 / how many
# ranks hold the same values, so the sum over the mesh counts each element once.
GradParts = Callable[[], list[tuple[torch.Tensor, float]]]


@dataclass
class GradPhases:
    """What :func:`finalize_grads` does for one rank; built by ``parallelize``."""

    tp_partial: list[nn.Parameter] = field(default_factory=list)
    tp_group: dist.ProcessGroup | None = None
    pipeline_before: Callable[[], None] = lambda: None
    data_parallel: Callable[[], None] = lambda: None
    pipeline_after: Callable[[], None] = lambda: None
    grad_parts: GradParts = lambda: []


@torch.no_grad()
def sum_partial_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Phase 1: one all-reduce (SUM over ``group``) of every partial gradient at once."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if not params:
        return
    # Every TP rank must call the same all-reduce: a missing gradient is a zero one.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
    # fp32 or wider whatever the gradients' dtype: a sum of bf16 parts would round once more
    dtype = accumulation_dtype(*(g.dtype for g in grads))
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def finalize_grads(phases: GradPhases) -> None:
    """Complete the step's gradients: tensor-parallel partial sums, then the data-parallel
    (or ZeRO) reduction, then the pipeline's shared weights."""
    sum_partial_grads(phases.tp_partial, phases.tp_group)
    phases.pipeline_before()
    phases.data_parallel()
    phases.pipeline_after()


@torch.no_grad()
def global_grad_norm(parts: list[tuple[torch.Tensor, float]]) -> float:
    """The 2-norm of the whole model's gradient over every rank of the job (collective
    over the default group)."""
    local = torch.zeros(1, dtype=torch.float64)
    for g, weight in parts:
        local += weight * sum_of_squares(g)
    dist.all_reduce(local)
    return math.sqrt(float(local))


@torch.no_grad()
def clip_grad_norm_(parts: list[tuple[torch.Tensor, float]], max_norm: float | None) -> float:
    """Scale every gradient part so the global norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_``: by ``max_norm / (norm + 1e-6)``); returns the
    norm before clipping. ``max_norm=None`` only measures it."""
    norm = global_grad_norm(parts)
    coef = clip_coefficient(norm, max_norm)
    if coef != 1.0:
        for g, _ in parts:
            g.mul_(coef)
    return norm


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """What clipping multiplies the gradients by: ``max_norm / (norm + 1e-6)`` when
    that is below 1 (torch's rule), else 1."""
    if max_norm is None:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0
