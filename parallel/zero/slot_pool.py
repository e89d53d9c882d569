"""Reusable full-size buffers for stage 3's gathered parameters and gradients (M_D).

A stage-3 unit needs a whole-unit buffer only while its layer runs (the gathered
parameters) or while its gradients are reduced. Buffers of one size are handed out and
taken back through a free list, so after the first step the same few buffers serve
every step: nothing is allocated per step, and memory cannot fragment. On a pycomm
group the buffers are shared memory, so the all-gather into them (and the
reduce-scatter out of them) is zero-copy.

With a budget (``keep_bytes``, the engine's ``max_live_bytes``) a returned buffer is kept
for reuse only while the buffers handed out and kept stay within it; the others are
freed at once (their memory goes back to the system, see
:func:`pycomm.arena.return_freed_memory`), so the pool holds at most the budget, or what
is in use when that is more.
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
        keep_bytes: the most bytes handed out and kept together (None: keep every
            returned buffer).
    """

    def __init__(self, group: dist.ProcessGroup | None, keep_bytes: int | None = None):
        self.group, self.keep_bytes = group, keep_bytes
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._live = 0
        self._kept = 0  # bytes of the free lists
        self._peak = 0  # most bytes handed out at once
        self._peak_reserved = 0  # most bytes handed out and kept together
        self.made = 0  # buffers made (a budget makes them again after freeing them)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(numel, dtype)]
        if free:
            buffer = free.pop()
            self._kept -= _nbytes(buffer)
        else:
            buffer = Arena.for_group(numel, dtype, self.group).buffer
            self.made += 1
        self._live += _nbytes(buffer)
        self._peak = max(self._peak, self._live)
        self._peak_reserved = max(self._peak_reserved, self._live + self._kept)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        size = _nbytes(buffer)
        self._live -= size
        if self.keep_bytes is None or self._live + self._kept + size <= self.keep_bytes:
            self._free[(buffer.numel(), buffer.dtype)].append(buffer)
            self._kept += size
        # else: dropped here, the last reference: its memory is freed

    def would_fit(self, nbytes: int) -> bool:
        """Whether handing out ``nbytes`` more stays within the budget (always, without)."""
        return self.keep_bytes is None or self._live + nbytes <= self.keep_bytes

    def stats(self) -> dict[str, int]:
        """``reserved_bytes`` (handed out and kept now), ``live_bytes`` (handed out now),
        ``peak_bytes`` (most handed out at once), ``peak_reserved_bytes`` and ``buffers``
        (made so far)."""
        return {"reserved_bytes": self._live + self._kept, "live_bytes": self._live,
                "peak_bytes": self._peak, "peak_reserved_bytes": self._peak_reserved,
                "buffers": self.made}


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.dtype.itemsize
