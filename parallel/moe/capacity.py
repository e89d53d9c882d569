"""Expert capacity: Megatron-LM's token dropping (``moe_expert_capacity_factor``).

Each call of a fused experts module - one replica's micro-batch of tokens, routed on the
rank that holds them, before any dispatch - gives every expert room for

    capacity = ceil(tokens * k / E * capacity_factor)

of its (token, choice) assignments. The rest are dropped: their weight becomes 0, so the
token keeps only its other experts' outputs (and the residual path), the expert receives
no gradient from them and neither does their routing weight. Which are kept, as Megatron's
``moe_token_drop_policy``: ``"probs"`` the assignments of highest routing weight,
``"position"`` the first tokens of the batch. Under expert parallelism the dropped
assignments are not dispatched at all. The load-balancing loss counts the routing before
dropping (as Megatron's). Dropless (no capacity) is the default.

The drop counts of a step are summed over the world and reported
(``StepResult.dropped``): one rank of each tensor-parallel group counts (its twins route
the same tokens).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..recompute.checkpoint import replaying

POLICIES = ("probs", "position")


def capacity_of(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Assignments each expert takes from a call of ``tokens`` tokens."""
    return math.ceil(tokens * top_k / experts * factor)


def kept(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int,
         factor: float, policy: str) -> torch.Tensor:
    """``(tokens, k)`` booleans: the assignments within their expert's capacity."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    n = flat.numel()
    if policy == "probs":  # highest weight first (ties: earlier assignment first)
        by_score = torch.argsort(top_k_weights.detach().reshape(-1).float(), descending=True,
                                 stable=True)
    else:
        by_score = torch.arange(n, device=flat.device)
    grouped = by_score[torch.argsort(flat[by_score], stable=True)]  # by expert, then score
    counts = torch.bincount(flat, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(n, device=flat.device) - starts[flat[grouped]]
    keep = torch.zeros(n, dtype=torch.bool, device=flat.device)
    keep[grouped] = place < capacity_of(tokens, k, experts, factor)
    return keep.view(tokens, k)


class DropCounter:
    """A step's dropped assignments on this rank (``local[0]``), then over the world."""

    def __init__(self, counts: bool):
        self.counts = counts
        self.local = torch.zeros(1, dtype=torch.float64)

    def reset(self) -> None:
        self.local.zero_()

    def add(self, keep: torch.Tensor) -> None:
        if self.counts and not replaying():  # a recomputed forward's drops are counted
            self.local += float((~keep).sum())

    def total(self) -> int:
        """Dropped assignments over the world (collective)."""
        total = self.local.clone()
        dist.all_reduce(total)
        return int(total[0])


def limit_capacity(module: nn.Module, experts: int, factor: float, policy: str,
                   counter: DropCounter) -> None:
    """Wrap ``module``'s forward (``(hidden, top_k_index, top_k_weights)``, every E
    experts' or - under expert parallelism - their dispatch, which also takes ``keep``)
    so that each call drops what exceeds the capacity (in place)."""
    forward = module.forward
    dispatches = getattr(module, "dispatches", False)

    def limited(hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        keep = kept(top_k_index, top_k_weights, experts, factor, policy)
        counter.add(keep)
        weights = top_k_weights * keep.to(top_k_weights.dtype)
        if dispatches:
            return forward(hidden, top_k_index, weights, keep=keep)
        return forward(hidden, top_k_index, weights)

    module.forward = limited
