"""ZeRO 1-2 beside expert parallelism: the dense parameters' optimizer state (and under
stage 2 their gradients) sharded over ``dp`` by ZeRO, the experts - each rank's
``E / ep`` of them, already split by ``ep`` - stepped whole by plain data parallelism,
their gradients summed over the expert-data-parallel group ``edp`` (``dp / ep`` ranks)
and divided by ``dp``. One optimizer for the scheduler and the step, whose parameter
groups are both sides' groups (an LR schedule reaches all of them).

The experts' state is not sharded over ``edp``: with ``ep = dp`` (the common layout)
each rank holds its experts alone and there is nothing to shard; with ``edp > 1`` their
state is ``edp`` times what a sharded one would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parallel.compose.apply_ep import is_expert


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
    """The data side of ZeRO 1-2 with ``ep > 1`` (see the module docstring): ``dense``
    (a ZeroPlan without the experts) and ``experts`` (a PlainDataParallel of them)."""

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

    def shard_grads_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return self.dense.shard_grads_of(params)

    def pieces(self) -> list[Any]:
        return [*self.dense.pieces(), *self.experts.pieces()]

    def set_scalars(self, p: nn.Parameter, scalars: dict[str, Any]) -> None:
        (self.experts if is_expert(p) else self.dense).set_scalars(p, scalars)

    def loaded(self) -> None:
        self.dense.loaded()
        self.experts.loaded()
