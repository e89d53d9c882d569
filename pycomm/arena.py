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

from collections.abc import Sequence

import torch

from pycomm._backend import _extension


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
    new slab (a measure of fragmentation)."""
    return dict(_extension().arena_stats())
