"""ZeRO-R's partitioned activations (P_a): a checkpoint input kept as ``1/N`` per rank.

Inside a tensor-parallel region every TP rank holds the same block input, so keeping it
on each rank wastes ``TP - 1`` copies: each rank keeps ``1/TP`` of its flattened
elements and the whole is all-gathered just before the recomputation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.recompute.arena import CheckpointArena

# torch 2.13 renamed the tensor form (the old name warns); older torch has only that.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class Stored:
    """One input as kept: whole, or this rank's part of its flattened elements."""

    def __init__(self, t: torch.Tensor, group: Any, offload: bool, arena: CheckpointArena):
        self.shape, self.device, self.requires_grad = t.shape, t.device, t.requires_grad
        self.group, self.numel, self.arena = group, t.numel(), arena
        flat = t.detach().reshape(-1)
        if group is not None:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            self.part = -(-self.numel // world)
            padded = torch.nn.functional.pad(flat, (0, self.part * world - self.numel))
            flat = padded[rank * self.part : (rank + 1) * self.part]
        if offload and flat.is_cuda:
            flat = flat.to("cpu", non_blocking=True)
        self.kept = arena.store(flat)

    def load(self) -> torch.Tensor:
        flat = self.kept.to(self.device, non_blocking=True)
        if self.group is not None:
            world = dist.get_world_size(self.group)
            full = torch.empty(self.part * world, dtype=flat.dtype, device=flat.device)
            _all_gather(full, flat.contiguous(), group=self.group)
            flat = full[: self.numel]
        return flat.detach().view(self.shape).requires_grad_(self.requires_grad)

    def release(self) -> None:
        """The recomputation is done with it: its arena slice may be reused."""
        self.arena.release()
