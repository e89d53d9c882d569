"""Tensors in pycomm's shared-memory arena (ZeRO-R's M_D): zero-copy collectives.

A tensor from :func:`empty` or :func:`zeros` lives in large preallocated shared-memory
slabs that the other ranks on the host can map. When every rank passes such a tensor to
a large all_reduce, reduce_scatter or all_gather, pycomm reads peers' data in place
instead of streaming it through the transport. On other backends these are ordinary
CPU tensors, so code that uses them runs anywhere.

Example::

    grads = pycomm.zeros(1 << 20)          # instead of torch.zeros
    dist.all_reduce(grads)                 # zero-copy when every rank does the same
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator, Sequence

import torch

from pycomm._extension import load as _extension


def _sizes(size: tuple[int | Sequence[int], ...]) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return [int(s) for s in size[0]]
    return [int(s) for s in size]  # type: ignore[arg-type]


def empty(*size: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor in the arena, shaped like ``torch.empty(*size)``.

    Raises:
        RuntimeError: if the arena cannot reserve the memory (the message says how much).
    """
    return _extension().arena_empty(_sizes(size), dtype)


def zeros(*size: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled CPU tensor in the arena, shaped like ``torch.zeros(*size)``."""
    return empty(*size, dtype=dtype).zero_()


def in_arena(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data lies in this process's arena."""
    return bool(_extension().in_arena(tensor))


def arena_stats() -> dict[str, int]:
    """Bytes ``reserved`` (all slabs), ``live`` (allocated now), ``peak``, and counts of
    ``slabs`` and ``allocations``; ``largest_free`` is the biggest block free without a
    new slab (a measure of fragmentation); ``trimmed`` the free bytes given back to the
    system (:func:`return_freed_memory`)."""
    return dict(_extension().arena_stats())


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory(threshold: int = 1 << 20) -> None:
    """From now on, freed buffers of ``threshold`` bytes or more go back to the system:
    this arena's blocks (their pages punched out of the shared slab, for every process
    mapping it; reserved again when handed out) and glibc's heap.

    Buffers that come and go every step (ZeRO-3's gathered units under a memory budget,
    offload's records and Adam's temporaries) would otherwise stay with the process once
    freed: the arena keeps a freed block for the next allocation, and glibc raises its
    mmap threshold to the largest chunk freed so far, after which such tensors come from
    its heap; a process would grow to a model's worth, the memory a budget or offload is
    there to save. glibc's part is a no-op where there is no ``mallopt``.
    """
    _extension().arena_trim_bytes(threshold)
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, threshold)


DEFAULT_MIN_BYTES = 1 << 20  # a DDP bucket (1 MiB first, 25 MiB after), not small tensors


@contextlib.contextmanager
def use_arena(min_bytes: int = DEFAULT_MIN_BYTES) -> Iterator[None]:
    """Inside the block, CPU tensors of at least ``min_bytes`` that this thread allocates
    (by any torch call) come from the arena, as :func:`empty` would give them.

    What :func:`empty` is for tensors a user makes, this is for tensors a library makes:
    DDP's gradient buckets, an optimizer's state. Collectives on them are zero-copy
    (peers read them in place) when every rank's buffer is in the arena. Like
    ``torch.cuda.use_mem_pool``, it routes the calling thread only; blocks nest (the
    innermost threshold counts). Tensors keep their arena memory after the block. Wrap
    what allocates the buffers: for DDP, construction and the first two steps (it
    rebuilds its buckets in the second forward), or simply the whole training loop.

    Example::

        with pycomm.use_arena():
            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
            for batch in loader:
                ...

    Raises:
        ValueError: if ``min_bytes`` < 1.
        RuntimeError: if torch's CPU allocator cannot be routed (another library
            replaced it with a higher priority).
        torch.OutOfMemoryError: from an allocation the arena cannot reserve.
    """
    if min_bytes < 1:
        raise ValueError(f"pycomm.use_arena: min_bytes must be at least 1, got {min_bytes}")
    ext = _extension()
    previous = ext._arena_block_open(int(min_bytes))
    try:
        yield
    finally:
        ext._arena_block_close(previous)
