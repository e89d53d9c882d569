"""One preallocated, contiguous buffer handed out as views (ZeRO-R's M_D).

Long-lived training buffers (gradients, gathered parameters) are carved out of one
flat tensor that is allocated once, so nothing is allocated per step, neighbouring
tensors are neighbours in memory (a bucket of them is one slice, one collective), and
fragmentation cannot happen. On a ``pycomm`` group the buffer comes from the
shared-memory arena (:func:`pycomm.empty`), so collectives on its slices are zero-copy;
on any other backend it is an ordinary tensor.

Example::

    arena = Arena(1 << 20, torch.float32, shared=True)
    grad = arena.allocate(weight.numel()).view_as(weight)
    arena.stats()   # {'reserved_bytes': 4194304, 'live_bytes': ..., 'peak_bytes': ..., ...}
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pycomm.arena import empty as shared_empty

# Views start on 64-byte boundaries (a cache line, one AVX-512 vector) so kernels that
# run on them are never misaligned.
ALIGN_BYTES = 64


def aligned_numel(numel: int, dtype: torch.dtype, align_bytes: int = ALIGN_BYTES) -> int:
    """``numel`` rounded up so the next view after it starts on an ``align_bytes`` boundary."""
    per_line = max(1, align_bytes // dtype.itemsize)
    return -(-numel // per_line) * per_line


def is_pycomm_group(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) runs on the pycomm backend."""
    return dist.is_initialized() and str(dist.get_backend(group)) == "pycomm"


class Arena:
    """A zero-filled flat buffer of ``numel`` elements; :meth:`allocate` bumps a pointer.

    Args:
        numel: capacity in elements.
        dtype: element type of every view.
        shared: take the buffer from pycomm's shared-memory arena (zero-copy collectives;
            CPU only).
        device: where an ordinary (not shared) buffer lives.
        align_bytes: alignment of each view's start.

    Raises:
        MemoryError: from :meth:`allocate` when the capacity would be exceeded (the
            message gives the request, what is live and the capacity).
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, shared: bool = False,
                 device: torch.device | str | None = None, align_bytes: int = ALIGN_BYTES):
        if numel < 0:
            raise ValueError(f"Arena: capacity must be >= 0 elements, got {numel}")
        self.dtype = dtype
        self.shared = shared
        self.align_bytes = align_bytes
        if shared and torch.device(device or "cpu").type != "cpu":
            raise ValueError(f"Arena: a shared arena lives in CPU memory, not on {device}")
        self.buffer = (
            shared_empty(numel, dtype=dtype) if shared
            else torch.empty(numel, dtype=dtype, device=device)
        )
        self.buffer.zero_()  # padding between views is reduced too: it must not hold garbage
        self._next = 0
        self._peak = 0
        self._allocations = 0

    @classmethod
    def for_group(cls, numel: int, dtype: torch.dtype, group: dist.ProcessGroup | None,
                  device: torch.device | str = "cpu") -> Arena:
        """An arena in shared memory for CPU tensors of a pycomm group, ordinary otherwise."""
        shared = is_pycomm_group(group) and torch.device(device).type == "cpu"
        return cls(numel, dtype, shared=shared, device=device)

    @property
    def capacity(self) -> int:
        """Capacity in elements."""
        return self.buffer.numel()

    def allocate(self, numel: int) -> torch.Tensor:
        """A 1-D view of the next ``numel`` elements (aligned start)."""
        start = self._next
        end = start + numel
        if end > self.capacity:
            raise MemoryError(
                f"Arena: cannot allocate {numel} x {self.dtype} elements: {start} of "
                f"{self.capacity} are live; size the arena for the whole layout up front"
            )
        self._next = min(self.capacity, start + aligned_numel(numel, self.dtype, self.align_bytes))
        self._peak = max(self._peak, self._next)
        self._allocations += 1
        return self.buffer[start:end]

    def offset_of(self, view: torch.Tensor) -> int:
        """Element offset of ``view``'s first element in the buffer.

        Raises:
            ValueError: if ``view`` does not lie in this arena.
        """
        # Compare storages, not data pointers: an empty view may report a null pointer.
        same = view.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        offset = view.storage_offset() - self.buffer.storage_offset()
        if not same or view.dtype != self.dtype or not 0 <= offset <= self.capacity - view.numel():
            raise ValueError("Arena.offset_of: the tensor is not a view of this arena")
        return int(offset)

    def reset(self) -> None:
        """Forget every view (their memory is handed out again); the peak is kept."""
        self._next = 0

    def stats(self) -> dict[str, int]:
        """``reserved_bytes`` (capacity), ``live_bytes`` (handed out now, padding
        included), ``peak_bytes`` and ``allocations`` (views handed out since creation)."""
        item = self.dtype.itemsize
        return {
            "reserved_bytes": self.capacity * item,
            "live_bytes": self._next * item,
            "peak_bytes": self._peak * item,
            "allocations": self._allocations,
        }
