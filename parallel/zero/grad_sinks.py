"""Where stage 3's reduce-scattered unit gradients go, chosen once with the shards' home.

:class:`IntoShardGrads` (the shards in memory): each unit's reduced gradient lands in
its slice of one gradient arena that the optimizer steps on; a backward that
accumulates (``fresh`` False) lands in scratch and is added once every unit is in.
:class:`StepOnArrival` (offloaded shards): a unit's reduced gradient lands in a buffer
of its own and goes straight to the unit's optimizer step, then is freed; no gradient
stays in memory between units. The reducer asks its sink; it never asks which.
"""

from __future__ import annotations

from typing import Any

import torch

from pycomm.flat_arena import Arena

from .units import Unit


class IntoShardGrads:
    """The reduced gradients in one arena of ``numel`` elements of ``dtype``, a view per
    unit (``shard_views(arena)``); see the module docstring."""

    def __init__(self, numel: int, dtype: torch.dtype, shard_views: Any):
        self.grads: Arena | None = Arena(numel, dtype)
        self.shard_grads: list[torch.Tensor] = shard_views(self.grads)
        self._numel, self._dtype = numel, dtype
        self._scratch: Arena | None = None
        self._landed: list[tuple[Unit, torch.Tensor]] = []  # reduced beside the shard grads

    def destination(self, u: Unit, fresh: bool) -> torch.Tensor:
        """``u``'s reduced gradient goes to its shard gradient, or beside it when this
        backward accumulates into it."""
        mine = self.shard_grads[u.index]
        if fresh:
            return mine
        if self._scratch is None:
            self._scratch = Arena(self._numel, self._dtype)
        assert self.grads is not None
        offset = self.grads.offset_of(mine)
        out = self._scratch.buffer[offset : offset + u.shard_numel]
        self._landed.append((u, out))
        return out

    def arrived(self, u: Unit, out: torch.Tensor, divide: int) -> None:
        """(Landed in place: the optimizer steps on it later.)"""

    def finish(self, fresh: bool, divide: int) -> bool:
        """Every unit is in: divide by ``divide`` (the sum where the backend has no AVG),
        add what accumulated beside. Returns whether the next backward accumulates."""
        assert self.grads is not None
        if divide != 1:
            reduced = [self.grads.buffer] if fresh else [out for _, out in self._landed]
            for t in reduced:
                t.div_(divide)
        for u, out in self._landed:
            self.shard_grads[u.index].add_(out)
        self._landed.clear()
        return True

    def zero(self) -> None:
        assert self.grads is not None
        self.grads.buffer.zero_()


class StepOnArrival:
    """Each unit's reduced gradient handed to ``offload.step_unit`` as it arrives; see
    the module docstring."""

    def __init__(self, offload: Any, dtype: torch.dtype):
        self.offload, self.dtype = offload, dtype
        self.grads: Arena | None = None  # nothing stays in memory
        self.shard_grads: list[torch.Tensor] = []

    def destination(self, u: Unit, fresh: bool) -> torch.Tensor:
        """A buffer for ``u``'s step alone."""
        return torch.empty(u.shard_numel, dtype=self.dtype)

    def arrived(self, u: Unit, out: torch.Tensor, divide: int) -> None:
        """``u`` steps on its reduced gradient (divided by ``divide``), which is freed."""
        self.offload.step_unit(u, out, divide)
        # Free it now: the bucketer's work (kept until the end of backward) holds it
        out.untyped_storage().resize_(0)

    def finish(self, fresh: bool, divide: int) -> bool:
        """Every unit stepped already: the next backward starts fresh."""
        return False

    def zero(self) -> None:
        """(No gradient is kept.)"""


GradSink = IntoShardGrads | StepOnArrival
