"""Dropout drawing from a named stream of the project's RNG tracker (:mod:`pycomm.parallel.rng`).

The tracker, its streams and :func:`model_parallel_seed` live in :mod:`pycomm.parallel.rng`
(every strategy uses them, recomputation replays them); they are re-exported here, where
earlier code imports them from. Recomputation is :func:`pycomm.parallel.recompute.checkpoint`
(a floor above: it replays this tracker).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..rng import (
    REPLICATED,
    TENSOR_PARALLEL,
    TRACKER,
    RNGTracker,
    model_parallel_seed,
)

__all__ = ["REPLICATED", "TENSOR_PARALLEL", "TRACKER", "RNGTracker", "TrackedDropout",
           "model_parallel_seed"]


class TrackedDropout(nn.Module):
    """``nn.Dropout`` drawing from a named stream of :data:`pycomm.parallel.rng.TRACKER`."""

    def __init__(self, p: float, stream: str):
        super().__init__()
        self.p, self.stream = p, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with TRACKER.fork(self.stream):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}"
