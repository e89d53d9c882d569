"""Reusable full-size buffers for stage 3's gathered parameters and gradients (M_D).

A stage-3 unit needs a whole-unit buffer only while its layer runs (the gathered
parameters) or while its gradients are reduced. Buffers of one size are handed out and
taken back through a free list, so after the first step the same few buffers serve
every step: nothing is allocated per step, and memory cannot fragment. On a pycomm
group the buffers are shared memory, so the all-gather into them (and the
reduce-scatter out of them) is zero-copy.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from pycomm.flat_arena import Arena


class SlotPool:
    """Buffers keyed by (elements, dtype); :meth:`take` reuses a returned one or makes one.

    Args:
        group: the group the buffers are used with (pycomm: shared memory).
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._arenas: list[Arena] = []
        self._live = 0
        self._peak = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(numel, dtype)]
        if free:
            buffer = free.pop()
        else:
            arena = Arena.for_group(numel, dtype, self.group)
            self._arenas.append(arena)
            buffer = arena.buffer
        self._live += buffer.numel() * dtype.itemsize
        self._peak = max(self._peak, self._live)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._live -= buffer.numel() * buffer.dtype.itemsize
        self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    def stats(self) -> dict[str, int]:
        """``reserved_bytes`` (every buffer made), ``live_bytes`` (handed out now),
        ``peak_bytes`` (most handed out at once) and ``buffers``."""
        reserved = sum(a.stats()["reserved_bytes"] for a in self._arenas)
        return {"reserved_bytes": reserved, "live_bytes": self._live, "peak_bytes": self._peak,
                "buffers": len(self._arenas)}
