"""fp16's dynamic loss scaling, over the whole mesh (Megatron-LM's and torch.amp's rule).

fp16 gradients underflow: backward starts from ``loss * scale`` instead, and the
gradients are divided by ``scale`` before clipping and the step. A scale too high
overflows to inf or nan somewhere; since every rank holds a part of the gradient, the
check is one all-reduce of a flag over the world, so every rank skips that step
together (its update is not applied, the learning-rate schedule does not advance) and
halves the scale. After ``window`` steps without an overflow the scale doubles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaler:
    """The scale, and the steps it skipped (see the module docstring)."""

    def __init__(self, initial: float, window: int, minimum: float = 1.0):
        if initial <= 0 or window < 1:
            raise ValueError(f"loss scaling: the initial scale must be > 0 and the window >= 1, "
                             f"got {initial} and {window}")
        self.scale, self.window, self.minimum = float(initial), window, minimum
        self.good_steps, self.skipped = 0, 0

    @torch.no_grad()
    def overflowed(self, parts: list[tuple[torch.Tensor, float]]) -> bool:
        """Whether any rank's gradient holds an inf or a nan (collective over the world)."""
        bad = any(not bool(torch.isfinite(g).all()) for g, _ in parts)
        flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    @torch.no_grad()
    def unscale(self, parts: list[tuple[torch.Tensor, float]]) -> None:
        inverse = 1.0 / self.scale
        for g, _ in parts:
            g.mul_(inverse)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.minimum, self.scale / 2)
            self.good_steps, self.skipped = 0, self.skipped + 1
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
