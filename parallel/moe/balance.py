"""The router's load-balancing loss as one process computes it, in every layout.

Switch Transformer's auxiliary loss, in HuggingFace's form (``load_balancing_loss_func``:
every MoE layer's routing of every real token, padding excluded)::

    aux = E * sum_e (T_e / R) * (P_e / R)

``T_e``: how many times expert ``e`` is among a token's top-k, ``P_e``: the sum of its
softmax probability, ``R``: rows counted (tokens x layers), all summed over every layer
and every token of the **global** batch. A layout sees a replica's rows, a micro-batch, a
pipeline stage's layers; the statistics are all-reduced over the world once every forward
of the step has run, before any backward, and the loss's gradient is then added where it
arises, in each router's backward (``coef * E * T_e / R^2`` on each token's
probabilities, through the softmax: Megatron-LM's ``MoEAuxLossAutoScaler`` idea, without a
loss term to carry across stages). So a micro-batch's backward needs every micro-batch's
forward done: GPipe's schedule, or one micro-batch.

:class:`RoutingStats` holds a step's statistics; :func:`track_router` wraps a router so that
its logits feed them and receive the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..recompute.checkpoint import replaying


@dataclass
class RoutingStats:
    """One step's routing statistics on this rank, then over the world.

    Args:
        experts: E.
        top_k: the experts each token is routed to.
        coef: the loss's weight (``router_aux_loss_coef``).
        counts: whether this rank's routing is counted (one rank of a tensor-parallel
            group, whose ranks route the same tokens).
        replicas: the data-parallel replicas whose gradients are averaged: a replica's
            part of the gradient is taken that many times, as its loss's share is.
    """

    experts: int
    top_k: int
    coef: float
    counts: bool = True
    replicas: int = 1
    mask: Callable[[], torch.Tensor | None] = lambda: None  # the micro-batch's padding mask
    local: torch.Tensor = field(init=False)  # [T_e..., P_e..., R]
    total: torch.Tensor | None = None  # the same over the world, once known

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.local = torch.zeros(2 * self.experts + 1, dtype=torch.float64)
        self.total = None

    def add(self, logits: torch.Tensor) -> None:
        """A router's logits ``(tokens, E)`` of the micro-batch being computed (not again
        when recompute reruns it)."""
        if not self.counts or replaying():
            return
        with torch.no_grad():
            probs = logits.float().softmax(dim=-1)
            chosen = probs.topk(self.top_k, dim=-1).indices
            mask = self.mask()
            weight = (torch.ones(probs.shape[0]) if mask is None
                      else mask.reshape(-1).to(torch.float32))
            e = self.experts
            self.local[:e] += torch.zeros(e).scatter_add_(
                0, chosen.reshape(-1), weight.repeat_interleave(self.top_k)).double()
            self.local[e:2 * e] += (probs * weight[:, None]).sum(0).double()
            self.local[2 * e] += float(weight.sum())

    def finish(self) -> None:
        """The world's statistics (collective over the world; once per step, after every
        forward and before any backward)."""
        total = self.local.clone()
        dist.all_reduce(total)
        self.total = total

    def loss(self) -> float:
        """``coef * aux`` of the step (after :meth:`finish`)."""
        assert self.total is not None
        e, rows = self.experts, max(float(self.total[2 * self.experts]), 1.0)
        tokens, probs = self.total[:e] / rows, self.total[e:2 * e] / rows
        return self.coef * e * float((tokens * probs).sum())

    def grad_per_prob(self) -> torch.Tensor:
        """``d (coef * aux) / d p_te`` for a counted token, ``coef * E * T_e / R^2``, times
        the replicas."""
        if self.total is None:
            raise RuntimeError("load balancing: a router's backward ran before the step's "
                               "routing statistics were complete (every forward of the step "
                               "must run before any backward: GPipe's schedule)")
        e, rows = self.experts, max(float(self.total[2 * self.experts]), 1.0)
        return self.coef * e * self.replicas * self.total[:e].float() / rows**2


class _BalanceGrad(torch.autograd.Function):
    """Forward: the logits as they are (counted into the statistics). Backward: plus the
    load-balancing loss's gradient through the softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, stats: RoutingStats) -> torch.Tensor:
        stats.add(logits)
        mask = stats.mask()
        ctx.stats = stats
        ctx.save_for_backward(logits, mask if mask is not None else torch.empty(0))
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Every rank adds it, counted or not: tensor-parallel twins route alike and keep
        # alike gradients of the (replicated) router.
        logits, mask = ctx.saved_tensors
        stats: RoutingStats = ctx.stats
        c = stats.grad_per_prob().to(logits.device)
        probs = logits.float().softmax(dim=-1)
        extra = probs * (c - (probs * c).sum(-1, keepdim=True))  # softmax's Jacobian
        if mask.numel():
            extra = extra * mask.reshape(-1, 1).to(extra.dtype)
        return grad + extra.to(grad.dtype), None


class _Carry(torch.autograd.Function):
    """Forward: ``carrier`` as it is. Backward: its gradient, and a zero one for
    ``passenger``, whose backward then runs (a branch off the loss's path would not)."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, passenger: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = passenger.shape, passenger.dtype
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)


@dataclass(frozen=True)
class RouterBalance:
    """Where a model's routers are and its load-balancing loss (a plan's ``balance``).

    Args:
        routers: pattern of the router modules (HuggingFace's ``*TopKRouter``: returning
            ``(logits, scores, indices)``, the scores weighting the experts' outputs).
        experts, top_k, coef: E, k and ``router_aux_loss_coef``.
    """

    routers: str
    experts: int
    top_k: int
    coef: float


def track_router(router: nn.Module, stats: RoutingStats) -> None:
    """Count ``router``'s logits into the statistics and give them the loss's gradient,
    carried by the scores it returns (which weight the experts' outputs), in place.

    Raises:
        TypeError: at its first call, a router that does not return (logits, scores, ...).
    """
    forward = router.forward

    def tracked(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) >= 2 and all(map(torch.is_tensor, out[:2]))):
            raise TypeError(f"load balancing: {type(router).__name__} returns "
                            f"{type(out).__name__}, not (logits, scores, ...)")
        logits, scores = out[0], out[1]
        scores = _Carry.apply(scores, _BalanceGrad.apply(logits, stats))
        return (logits, scores, *out[2:])

    router.forward = tracked
