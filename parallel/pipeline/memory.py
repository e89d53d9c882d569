"""Measuring the activation memory a stage holds for backward.

:class:`ActivationMeter` counts the bytes of the tensors autograd saves for backward
(parameters excluded, each storage once) while they are alive, and keeps the peak. That
is the memory re-materialization and the 1F1B schedule are about: GPipe without
checkpointing holds every micro-batch's activations at the turn from forward to
backward; with checkpointing only each stage's inputs; 1F1B at most ``K - s``
micro-batches'.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class _Held:
    """What autograd keeps in place of a saved tensor; its death frees the bytes."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """``with meter.measure(model): ...`` then ``meter.peak_bytes``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}  # storage pointer -> saved tensors holding it

    @contextmanager
    def measure(self, module: nn.Module | None = None,
                exclude: Iterable[torch.Tensor] = ()) -> Iterator[ActivationMeter]:
        """Count while inside; ``module``'s parameters and ``exclude`` are not counted."""
        owned = [*module.parameters()] if module is not None else []
        params = {t.untyped_storage().data_ptr() for t in [*owned, *exclude]}

        def pack(t: torch.Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr in params or ptr == 0:
                return t
            if self._refs.get(ptr, 0) == 0:
                self.live += t.untyped_storage().nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live)
            self._refs[ptr] = self._refs.get(ptr, 0) + 1
            held = _Held(t)
            weakref.finalize(held, self._release, ptr, t.untyped_storage().nbytes())
            return held

        def unpack(held: Any) -> torch.Tensor:
            return held.tensor if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= nbytes
