"""Where a composed job's ZeRO keeps its optimizer state, chosen once by ``ZeroPlan``.

:class:`InMemory`: the master shards, their reduced gradients and the optimizer state
are tensors of the ZeRO optimizer. :class:`StateInStore` (ZeRO-Offload, stages 1-2):
the optimizer state lives in a unit store, stepped bucket by bucket; checkpoints view
it there. :class:`UnitsInStore` (stage 3 offloaded): each unit's master, gradient and
state live in the store and each unit steps in backward (or, deferred, after the norm
is known), so the norm is the sum of squares the store counted and a tie's gradient is
combined in its unit's record. ``ZeroPlan`` asks its state; it never asks which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SumGrads = Callable[[list[tuple[torch.Tensor, Any]]], None]


class InMemory:
    """Everything in the ZeRO optimizer's tensors."""

    store: Any = None

    def pieces(self, side: Any) -> list[Any]:
        """For checkpoints: views of the shards and the optimizer state."""
        return side.memory_pieces()

    def release_view(self) -> Any:
        """(No chunk views a store.)"""
        return None

    def saved(self) -> None:
        """(Checkpoints read the tensors in place.)"""

    def step_deferred(self, unscale: float, clip: float) -> None:
        """(The optimizer's step steps every shard.)"""

    def discard_deferred(self) -> None:
        """(A skipped step leaves nothing waiting.)"""

    def grad_parts(self, side: Any) -> list[tuple[torch.Tensor, float]]:
        """This rank's gradient for the global norm: its shards, per parameter."""
        return side.shard_grad_parts()

    def sum_tied(self, side: Any, tied: list[tuple[nn.Parameter, Any]],
                 sum_grads: SumGrads) -> None:
        """Each tied parameter's reduced shard (its unit holds it alone), summed over
        its group."""
        shards = side.shard_grads_of([p for p, _ in tied])
        sum_grads([(s, g) for s, (_, g) in zip(shards, tied, strict=True)])


class StateInStore(InMemory):
    """The optimizer state in ``store`` (a ``UnitOffload``); see the module docstring."""

    def __init__(self, store: Any):
        self.store = store

    def pieces(self, side: Any) -> list[Any]:
        """For checkpoints: the state as views of the store (streamed, never read whole)."""
        return side.stored_pieces(self.store)

    def release_view(self) -> Any:
        """How a chunk viewing the store lets its pages go."""
        return self.store.release_view

    def saved(self) -> None:
        """After a checkpoint was written from (or read into) the store's views."""
        self.store.end_stored()


class UnitsInStore(StateInStore):
    """Stage 3's units in ``store``, stepped in backward; see the module docstring."""

    def step_deferred(self, unscale: float, clip: float) -> None:
        """Deferred (clipping, loss scaling, a tie across stages): every unit steps now,
        its gradient times ``unscale`` then ``clip`` (each skipped where it is 1)."""
        if self.store.defer:
            self.store.grad_factors = [f for f in (unscale, clip) if f != 1.0]
            self.store.step_deferred()

    def discard_deferred(self) -> None:
        """A skipped step: the records' waiting gradients are dropped."""
        self.store.discard_deferred()

    def grad_parts(self, side: Any) -> list[tuple[torch.Tensor, float]]:
        """The shards are gone: the sum of their squares, as the store counted it."""
        local = torch.tensor([self.store.grad_square_sum], dtype=torch.float64)
        return [(local.sqrt(), 1.0)]

    def sum_tied(self, side: Any, tied: list[tuple[nn.Parameter, Any]],
                 sum_grads: SumGrads) -> None:
        """Each tied parameter's gradient, waiting in its unit's record, summed over its
        group."""
        for unit, group in side.units_of(tied):
            self.store.combine_deferred_grad(
                self.store.units[unit], lambda grad, group=group: sum_grads([(grad, group)]))


ZeroState = InMemory | StateInStore | UnitsInStore
