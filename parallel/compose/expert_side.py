"""ZeRO beside expert parallelism: the dense parameters under ZeRO 1-3 over ``dp``; the
experts - each rank's ``E / ep`` of them, already split by ``ep`` and never gathered by
ZeRO (stage 3 leaves them whole) - their gradients summed over the expert-data-parallel
group ``edp`` (the ``dp / ep`` ranks holding the same experts) and divided by ``dp``.
With ``edp > 1`` the experts have their own ZeRO over ``edp`` (stage 2 under stage 3:
dispatch, not ZeRO, brings tokens to them, so their parameters stay whole), which shards
their gradients and optimizer state as Megatron's expert-data-parallel distributed
optimizer does; with ``ep = dp`` each rank holds its experts alone and steps them whole.
One optimizer for the scheduler and the step, whose parameter groups are both sides'
groups (an LR schedule reaches all of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .apply_ep import is_expert


class JointOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one; ``param_groups`` are theirs (the same dicts)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([g for part in parts for g in part.param_groups], {})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


class ExpertsBeside:
    """The data side of ZeRO with ``ep > 1`` (see the module docstring): ``dense`` (a
    ZeroPlan without the experts) and ``experts`` (their ZeroPlan over edp, or a
    PlainDataParallel of them where edp = 1)."""

    def __init__(self, dense: Any, experts: Any):
        self.dense, self.experts = dense, experts
        self.params: list[nn.Parameter] = [*dense.params, *experts.params]
        self.optimizer = JointOptimizer([dense.optimizer, experts.optimizer])

    def reduce(self) -> None:
        self.dense.reduce()
        self.experts.reduce()

    def after_step(self) -> None:
        self.dense.after_step()
        self.experts.after_step()

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        return [*self.dense.grad_parts(), *self.experts.grad_parts()]

    def sum_tied_shards(self, tied: list[tuple[nn.Parameter, Any]],
                        sum_grads: Callable[[list[tuple[torch.Tensor, Any]]], None]) -> None:
        self.dense.sum_tied_shards(tied, sum_grads)

    def pieces(self) -> list[Any]:
        return [*self.dense.pieces(), *self.experts.pieces()]

    def set_scalars(self, p: nn.Parameter, scalars: dict[str, Any]) -> None:
        (self.experts if is_expert(p) else self.dense).set_scalars(p, scalars)

    def release_view(self) -> Any:
        return self.dense.release_view() or self.experts.release_view()

    def saved(self) -> None:
        self.dense.saved()
        self.experts.saved()

    def loaded(self) -> None:
        self.dense.loaded()
        self.experts.loaded()
