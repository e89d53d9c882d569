"""Where checkpointed inputs wait for their backward: one buffer reused every step (M_D).

Each checkpoint stores its inputs in a slice of one byte buffer, handed out by bumping
an offset; when the last stored input of a step is released (its backward ran), the
offset goes back to zero, so the next step reuses the same memory. A step that needs
more than the buffer holds gets ordinary tensors for the rest and the buffer is grown
to the step's peak once nothing is live, so from then on every step fits.
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: every slice starts on a cache line


class CheckpointArena:
    """A reusable byte buffer for saved inputs (CPU; pinned when ``pin``)."""

    def __init__(self, capacity_bytes: int = 0, pin: bool = False):
        self.pin = pin and torch.cuda.is_available()
        self._buffer = self._make(capacity_bytes)
        self._offset = 0
        self._live = 0  # slices handed out and not yet released
        self._step_peak = 0  # bytes this step needed (fitting or not)
        self.peak_bytes = 0  # the most bytes live at once, any step
        self.overflows = 0  # slices that did not fit (ordinary tensors instead)

    def _make(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    @property
    def capacity_bytes(self) -> int:
        return self._buffer.numel()

    def store(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (contiguous, same dtype and shape) living in the arena."""
        nbytes = t.numel() * t.element_size()
        start = self._offset
        self._offset += -(-nbytes // ALIGN) * ALIGN
        self._step_peak = max(self._step_peak, self._offset)
        self.peak_bytes = max(self.peak_bytes, self._offset)
        self._live += 1
        if self._offset > self.capacity_bytes:
            self.overflows += 1
            return t.detach().to("cpu" if self.pin else t.device, copy=True).contiguous()
        view = self._buffer[start : start + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.detach(), non_blocking=self.pin)
        return view

    def release(self) -> None:
        """One stored slice is no longer needed; the last one of a step resets the arena."""
        self._live -= 1
        if self._live == 0:
            if self._step_peak > self.capacity_bytes:  # grow once, to what the step needed
                self._buffer = self._make(self._step_peak)
            self._offset = self._step_peak = 0

    def stats(self) -> dict[str, int]:
        return {"reserved_bytes": self.capacity_bytes, "live_bytes": self._offset,
                "peak_bytes": self.peak_bytes, "overflows": self.overflows}
