"""Pieces of a whole tensor in the whole tensor's coordinates: what one rank holds of a
parameter (its tensor-parallel part, or a flat ZeRO range of that part) as a few
rectangular :class:`Chunk` s whose data are views of the live buffer
(:func:`chunks_of`), the form a sharded checkpoint saves and loads
(:mod:`pycomm.parallel.checkpointing.dcp_chunks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..tensor.sharding import TPSpec, spec_of

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass
class Chunk:
    """A rectangle of a tensor: ``offsets`` in the global tensor, ``data`` shaped like
    it (possibly a view into live storage: load writes into it in place)."""

    offsets: tuple[int, ...]
    data: torch.Tensor


@dataclass
class ChunkedTensor:
    """This rank's parts of a tensor of global ``shape``; other ranks may hold the same
    (replicated) chunks, and a rank may hold none."""

    shape: torch.Size
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)


# --- which rectangles of the global tensor a flat range of a TP part is -------------------

def chunks_of(full_shape: torch.Size | tuple[int, ...], spec: TPSpec, tp_world: int,
              tp_rank: int, flat: torch.Tensor, flat_start: int) -> list[Chunk]:
    """The chunks, in global coordinates, that ``flat`` holds.

    Args:
        full_shape: the whole tensor's shape.
        spec, tp_world, tp_rank: the tensor-parallel split (``spec.shard(full, tp_world,
            tp_rank)`` is this rank's TP-local tensor).
        flat: 1-D, elements ``[flat_start, flat_start + flat.numel())`` of the TP-local
            tensor flattened row-major (a ZeRO shard; the whole part without ZeRO).
        flat_start: where ``flat`` starts in the flattened TP-local tensor.

    Returns chunks whose data are views of ``flat``.

    Raises:
        ValueError: the split does not divide the shape, or the range lies outside the
            TP-local tensor, or ``flat`` is not 1-D.
    """
    full = tuple(full_shape)
    local, dim = _local_shape(full, spec, tp_world, tp_rank)
    if flat.dim() != 1 or flat_start < 0 or flat_start + flat.numel() > math.prod(local):
        raise ValueError(f"flat range [{flat_start}, {flat_start + flat.numel()}) "
                         f"(flat of shape {tuple(flat.shape)}) is not inside the TP-local "
                         f"tensor of shape {local}")
    out, pos = [], 0
    for offsets, sizes in _row_major_boxes(local, flat_start, flat_start + flat.numel()):
        n = math.prod(sizes)
        data = flat[pos:pos + n].view(sizes)
        pos += n
        if dim is None:
            out.append(Chunk(offsets, data))
        else:
            block = local[dim] // spec.interleave
            out += _to_global(offsets, data, dim, block, tp_world, tp_rank)
    return out


def whole_shape(local: torch.Size, p: nn.Parameter, tp: int) -> torch.Size:
    """The unsplit tensor's shape of ``p``'s tensor-parallel-local shape ``local``."""
    dim = spec_of(p).dim
    if dim is None:
        return local
    whole = list(local)
    whole[dim] *= tp
    return torch.Size(whole)


def _local_shape(full: tuple[int, ...], spec: TPSpec, world: int,
                 rank: int) -> tuple[tuple[int, ...], int | None]:
    """The TP-local shape and the (non-negative) split dim, None when not split."""
    if not 0 <= rank < world:
        raise ValueError(f"tp_rank {rank} is not in [0, {world})")
    if spec.dim is None or world == 1:
        return full, None
    if not -len(full) <= spec.dim < len(full):
        raise ValueError(f"split dim {spec.dim} does not exist in shape {full}")
    dim = spec.dim % len(full)
    parts = spec.interleave * world
    if spec.interleave < 1 or full[dim] % parts:
        raise ValueError(f"dim {dim} of shape {full} does not split into {spec.interleave} "
                         f"blocks x {world} ranks")
    return full[:dim] + (full[dim] // world,) + full[dim + 1:], dim


def _row_major_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Rectangles, in order, covering elements ``[start, stop)`` of a row-major tensor:
    a partial leading row, full rows, a partial trailing row (the partial rows recursively
    in the lower dims). Each is one contiguous run of the range."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    first, last = -(-start // row), stop // row  # full rows are [first, last)
    if first > last:  # inside one row
        return _in_row(shape, first - 1, start, stop)
    boxes = _in_row(shape, first - 1, start, first * row) if start < first * row else []
    if last > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))
    if stop > last * row:
        boxes += _in_row(shape, last, last * row, stop)
    return boxes


def _in_row(shape: tuple[int, ...], r: int, start: int, stop: int) -> list[Box]:
    """The boxes of ``[start, stop)``, all inside row ``r``, as 1-high boxes."""
    row = math.prod(shape[1:])
    inner = _row_major_boxes(shape[1:], start - r * row, stop - r * row)
    return [((r,) + offsets, (1,) + sizes) for offsets, sizes in inner]


def _to_global(offsets: tuple[int, ...], data: torch.Tensor, dim: int, block: int,
               world: int, rank: int) -> list[Chunk]:
    """A TP-local box in global coordinates: local index ``k * block + j`` along ``dim``
    is global ``(k * world + rank) * block + j``, so the box is cut at block edges."""
    out = []
    lo, hi = offsets[dim], offsets[dim] + data.shape[dim]
    i = lo
    while i < hi:
        k, j = divmod(i, block)
        n = min(hi, (k + 1) * block) - i
        where = offsets[:dim] + ((k * world + rank) * block + j,) + offsets[dim + 1:]
        out.append(Chunk(where, data.narrow(dim, i - lo, n)))
        i += n
    return out


# --- checks shared by save and load -----------------------------------------------------

def as_chunked(key: str, value: Any) -> ChunkedTensor | None:
    """A tensor value as a ChunkedTensor (a plain tensor is one whole chunk), checked;
    None for an object."""
    if isinstance(value, torch.Tensor):
        value = ChunkedTensor(value.shape, value.dtype, [Chunk((0,) * value.dim(), value)])
    if not isinstance(value, ChunkedTensor):
        return None
    for c in value.chunks:
        if c.data.dtype != value.dtype or not inside(value.shape, c.offsets, c.data.shape):
            raise ValueError(f"key {key!r}: chunk at {tuple(c.offsets)} of shape "
                             f"{tuple(c.data.shape)} {c.data.dtype} does not fit its "
                             f"{value.dtype} tensor of shape {tuple(value.shape)}")
    return value


def inside(shape: torch.Size, offsets: Any, sizes: Any) -> bool:
    """Whether the box lies in ``shape`` (and is well formed: non-negative ints)."""
    if not (isinstance(offsets, (tuple, list)) and isinstance(sizes, (tuple, list))):
        return False
    return (len(offsets) == len(sizes) == len(shape)
            and all(type(v) is int and v >= 0 for v in (*offsets, *sizes))
            and all(o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True)))


def show(box: Any) -> str:
    """A box's offsets or sizes for a message, whatever the metadata held."""
    return str(tuple(box)) if isinstance(box, (tuple, list)) else repr(box)


def describe(shape: torch.Size, dtype: torch.dtype) -> str:
    return f"{dtype} tensor of shape {tuple(shape)}"


def disjoint(boxes: list[Box]) -> bool:
    """No two (non-empty) boxes share an element: a sweep along dim 0."""
    if len(boxes) < 2:
        return True
    if not boxes[0][0]:
        return False  # two boxes of a 0-d tensor are the same element
    active: list[Box] = []
    for box in sorted(boxes):
        active = [a for a in active if a[0][0] + a[1][0] > box[0][0]]
        if any(overlap(a, box) for a in active):
            return False
        active.append(box)
    return True


def overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_
               for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))
