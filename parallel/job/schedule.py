"""The learning-rate schedule: linear warmup, then a cosine decay to a floor (nanoGPT's)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WarmupCosine:
    """``lr_lambda`` for ``LambdaLR``: the factor of the peak learning rate at scheduler
    step ``i`` (0-based: the optimizer step ``i + 1``).

    ``(i + 1) / warmup`` for the first ``warmup`` steps, then a half cosine from 1 down to
    ``min_ratio`` at the last step. A dataclass, not a closure, so that ``LambdaLR``'s
    ``state_dict`` (and so a checkpoint) carries its settings.
    """

    steps: int
    warmup: int
    min_ratio: float

    def __call__(self, i: int) -> float:
        if i < self.warmup:
            return (i + 1) / self.warmup
        decay_steps = max(1, self.steps - 1 - self.warmup)
        progress = min(1.0, (i - self.warmup) / decay_steps)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
