"""The ranks' side of tests/test_dcp_chunks.py: a model's tensors split over a (tp, dp)
layout, tensor-parallel and, under ZeRO, each TP part's flat range split over dp,
saved in one layout and loaded in another.

Rank ``r`` of a layout's group is tp rank ``r % tp`` and dp rank ``r // tp``. Every
value is float64 from a fixed seed, so the tests compare exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pycomm.parallel.checkpointing.dcp_chunks import Chunk, ChunkedTensor, chunks_of, load, save
from pycomm.parallel.tensor.sharding import TPSpec

TENSORS = {  # name -> (global shape, split)
    "w_row": ((8, 6), TPSpec(0)),
    "w_col": ((5, 8), TPSpec(-1)),
    "qkv": ((12, 4), TPSpec(0, interleave=3)),
    "qkv_col": ((3, 12), TPSpec(1, interleave=3)),
    "bias": ((7,), TPSpec()),  # replicated over tp, ZeRO-split over dp
    "scale": ((), TPSpec()),
}
OBJECT = {"step": 7, "lr": [0.1, 0.2], "name": "gpt"}
_GROUPS: dict[int, Any] = {}  # group size -> the group of ranks [0, size), made once


def full(name: str) -> torch.Tensor:
    """The whole tensor ``name``, the same in every process."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(TENSORS[name][0], generator=gen, dtype=torch.float64)


def replicated() -> torch.Tensor:
    """A plain tensor every rank holds whole."""
    return torch.arange(5, dtype=torch.float64) / 4


def flat_range(n: int, dp: int, dp_rank: int, skew: int) -> tuple[int, int]:
    """dp rank ``dp_rank``'s part of ``[0, n)``: ``dp`` contiguous ranges, the inner
    bounds shifted by ``skew`` (so layouts with the same dp still differ)."""
    inner = sorted(min(n, max(0, n * k // dp + skew)) for k in range(1, dp))
    bounds = [0, *inner, n]
    return bounds[dp_rank], bounds[dp_rank + 1]


def pieces(rank: int, tp: int, dp: int, zero: bool, skew: int,
           fill: float | None = None) -> tuple[dict[str, Any], dict, dict]:
    """This rank's state (a ChunkedTensor per tensor, over a flat buffer holding the
    values, or ``fill`` to load into), the buffers, and the values they should hold."""
    tp_rank, dp_rank = rank % tp, rank // tp
    state: dict[str, Any] = {}
    bufs, want = {}, {}
    for name, (shape, spec) in TENSORS.items():
        local = spec.shard(full(name), tp, tp_rank).reshape(-1)
        lo, hi = flat_range(local.numel(), dp, dp_rank, skew) if zero else (0, local.numel())
        want[name] = local[lo:hi].clone()
        bufs[name] = want[name].clone() if fill is None else torch.full_like(want[name], fill)
        chunks = chunks_of(shape, spec, tp, tp_rank, bufs[name], lo)
        state[name] = ChunkedTensor(torch.Size(shape), torch.float64, chunks)
    return state, bufs, want


def _group(size: int) -> tuple[Any, bool]:
    """The group of ranks ``[0, size)`` (None: the world) and whether this rank is in it.
    Every rank makes the same groups in the same order, as new_group requires."""
    if size == dist.get_world_size():
        return None, True
    if size not in _GROUPS:
        _GROUPS[size] = dist.new_group(list(range(size)))
    return _GROUPS[size], dist.get_rank() < size


def save_layout(path: str, tp: int, dp: int, zero: bool, skew: int = 0) -> None:
    """Save every tensor as this layout splits it, plus a replicated tensor and an object."""
    group, member = _group(tp * dp)
    if not member:
        return
    state, _, _ = pieces(dist.get_rank(group), tp, dp, zero, skew)
    save({**state, "rep": replicated(), "meta": OBJECT}, path, group)


def load_layout(path: str, tp: int, dp: int, zero: bool, skew: int = 0) -> list[str] | None:
    """Load into this layout's buffers (NaN before); the names of the wrong values."""
    group, member = _group(tp * dp)
    if not member:
        return None
    state, bufs, want = pieces(dist.get_rank(group), tp, dp, zero, skew, fill=float("nan"))
    rep = torch.zeros(5, dtype=torch.float64)
    objects = load({**state, "rep": rep, "meta": None}, path, group)
    bad = [name for name in TENSORS if not torch.equal(bufs[name], want[name])]
    bad += [] if torch.equal(rep, replicated()) else ["rep"]
    return bad + ([] if objects == {"meta": OBJECT} else ["meta"])


def load_errors(path: str) -> dict[str, tuple[str, bool] | None]:
    """Loads that must fail on every rank, together and before writing anything: a key
    the checkpoint lacks, and (on rank 1 only) a wrong global shape. Per case: the
    message and whether the buffer stayed untouched."""
    out: dict[str, tuple[str, bool] | None] = {}
    for case in ("missing", "shape"):
        buf = torch.zeros(48, dtype=torch.float64)
        shape = (8, 7) if case == "shape" and dist.get_rank() == 1 else (8, 6)
        state: dict[str, Any] = {"w_row": ChunkedTensor(
            torch.Size(shape), torch.float64, [Chunk((0, 0), buf[:42].view(7, 6))])}
        if case == "missing":
            state["no_such_key"] = torch.zeros(3)
        try:
            load(state, path)
            out[case] = None
        except ValueError as exc:
            out[case] = (str(exc), bool((buf == 0).all()))
    return out


def interrupted_save(path: str, fresh: str) -> dict[str, Any]:
    """A save that fails while writing (an object that cannot be pickled), over the
    complete checkpoint at ``path`` and at the new ``fresh``: ``path`` still loads the
    old values, and ``fresh`` (only ``fresh.partial`` on disk) is no checkpoint."""
    state, _, _ = pieces(dist.get_rank(), 2, 2, True, 0)
    out: dict[str, Any] = {}
    for where in (path, fresh):
        try:
            save({**state, "meta": lambda: None}, where)
            out[where] = "saved"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            out[where] = type(exc).__name__
    out["old"] = load_layout(path, 2, 2, True)
    try:
        load_layout(fresh, 2, 2, True)
        out["fresh"] = "loaded"
    except ValueError as exc:
        out["fresh"] = str(exc)
    return out


def save_then_load(path: str) -> list[str] | None:
    """Save at tp=1 with ZeRO over dp=2, load at tp=2: the wrong values' names."""
    save_layout(path, 1, 2, True, 1)
    return load_layout(path, 2, 1, False)
