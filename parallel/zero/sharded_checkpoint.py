"""Sharded checkpoints of ZeRO training on ``torch.distributed.checkpoint`` (DCP): each
rank writes only its shards, and any data-parallel world size, stage or (for a
tensor-parallel model) TP size loads them.

Every parameter is saved as the whole tensor of the unsplit model under
``param/<name>`` (the fp32 masters under mixed precision), each of its optimizer state
tensors (Adam's moments) as ``optim/<key>/<name>``: a rank contributes the flat ranges
its master shards hold as chunks in the whole tensor's coordinates
(:mod:`pycomm.parallel.checkpointing.dcp_chunks`, as the composed engine's checkpoints); chunks that
tensor-parallel ranks hold alike (a replicated LayerNorm) are written once. Loading
asks for the chunks the loading layout holds and DCP reads what overlaps them. Beside
them: the model's buffers (``buffer/<name>``, whole) and, as objects, the format, the
parameter groups (members by name, hyper-parameters) and the scalar optimizer state
(Adam's step). A directory that exists is complete; :func:`consolidate` reads the plain
``state_dict`` from it in one process.

A tensor-parallel model (its parameters marked by
:func:`pycomm.parallel.tensor.apply_tensor_parallel`) saves and loads collectively over the
world, which must be its data- x tensor-parallel grid. A layout the parameters do not
describe (a pipeline stage) passes ``shard_key``: the optimizer's group then writes its
own checkpoint, ``<path>/<shard_key>``, of the tensors as its ranks hold them.

Example::

    save_sharded("ckpt/step10", model, opt)        # every rank
    load_sharded("ckpt/step10", model, opt)        # every rank, any layout
    full = consolidate("ckpt/step10")              # no process group needed
    plain_model.load_state_dict(full)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpointing import dcp_chunks
from ..checkpointing.chunks import ChunkedTensor, chunks_of, whole_shape
from ..checkpointing.optim_groups import ensure_state
from ..tensor.sharding import model_parallel_groups, spec_of
from .param_groups import options
from .zero_optimizer import ZeroOptimizer

FORMAT = "pycomm.zero-dcp/1"
META = ("meta/format", "meta/groups", "meta/scalar_state")


def owned_pieces(opt: ZeroOptimizer) -> list[tuple[int, int, int, int, int]]:
    """(param index, bucket, lo, hi, offset in the bucket shard) for this rank's elements."""
    numels = [shape.numel() for shape in opt.param_shapes()]
    pieces = []
    for k, bucket in enumerate(opt.layout.buckets):
        mine = bucket.shard_of(opt.rank)
        for i in bucket.params:
            start = opt.layout.offsets[i]
            lo, hi = max(start, mine.start), min(start + numels[i], mine.stop)
            if lo < hi:
                pieces.append((i, k, lo - start, hi - start, lo - mine.start))
    return pieces


def state_slices(opt: ZeroOptimizer, k: int, at: int, n: int) -> dict[str, torch.Tensor]:
    """The optimizer state of elements ``[at, at + n)`` of this rank's shard of bucket
    ``k`` (views: they lie in one piece, as a parameter's elements share one group)."""
    j = next(j for j, p in enumerate(opt.pieces) if p.bucket == k and p.start <= at < p.stop)
    piece, param = opt.pieces[j], opt.piece_params[j]
    lo = at - piece.start
    return {key: t[lo : lo + n] for key, t in opt.optimizer.state.get(param, {}).items()
            if torch.is_tensor(t) and t.shape == param.shape}


@dataclass(frozen=True)
class _Where:
    """Where a rank's checkpoint is, the group that writes it, and the tensor-parallel
    split its tensors are chunks of (1, 0: the tensors as this rank holds them)."""
    folder: Path
    group: Any
    tp: int
    tp_rank: int


def _where(path: str | os.PathLike, opt: ZeroOptimizer, shard_key: str | None) -> _Where:
    """``shard_key``'s folder and the optimizer's group, tensors as held; else ``path``,
    over the world for a tensor-parallel model (whole tensors), else the group."""
    if shard_key is not None:
        if not shard_key or "/" in shard_key or shard_key[0] == ".":
            raise ValueError(f"zero checkpoint: shard_key {shard_key!r} is not a plain "
                             "folder name")
        return _Where(Path(path) / shard_key, opt.group, 1, 0)
    groups = model_parallel_groups(opt.params)
    if len(groups) > 1:
        raise ValueError("zero checkpoint: the parameters lie in several tensor-parallel "
                         "groups; pass shard_key to name this rank's position")
    if not groups:
        return _Where(Path(path), opt.group, 1, 0)
    tp_group: Any = groups[0]
    tp, world = dist.get_world_size(tp_group), dist.get_world_size()
    if opt.world * tp != world:
        raise ValueError(f"zero checkpoint: data-parallel ({opt.world}) x tensor-parallel "
                         f"({tp}) = {opt.world * tp} ranks, not the world ({world}); pass "
                         "shard_key so that each data-parallel group writes its own folder")
    return _Where(Path(path), None, tp, dist.get_rank(tp_group))


def _buffers(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The state that is not a parameter (stage 3's shards are parameters too)."""
    params = set(names)
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if n not in params and not isinstance(t, nn.Parameter)}


def _tensors(model: nn.Module, opt: ZeroOptimizer, names: list[str],
             where: _Where) -> dict[str, Any]:
    """This rank's chunks of every parameter (a key even where it holds none) and of
    its optimizer state, views of the shards (load fills them in place); the buffers."""
    shapes = opt.param_shapes()
    out: dict[str, Any] = {
        f"param/{n}": ChunkedTensor(whole_shape(s, p, where.tp), opt.precision.master)
        for n, s, p in zip(names, shapes, opt.params, strict=True)}
    for i, k, lo, hi, at in owned_pieces(opt):
        p, whole = opt.params[i], out[f"param/{names[i]}"].shape
        flats = {"param": opt.shard_params[k].detach()[at : at + hi - lo],
                 **{f"optim/{key}": t for key, t in state_slices(opt, k, at, hi - lo).items()}}
        for prefix, flat in flats.items():
            target = out.setdefault(f"{prefix}/{names[i]}", ChunkedTensor(whole, flat.dtype))
            target.chunks += chunks_of(whole, spec_of(p), where.tp, where.tp_rank, flat, lo)
    out.update({f"buffer/{n}": b for n, b in _buffers(model, names).items()})
    return out


def _objects(opt: ZeroOptimizer, names: list[str]) -> dict[str, Any]:
    groups = [{"params": [names[i] for i in ids], "options": options(g)}
              for g, ids in zip(opt.param_groups, opt.group_params, strict=True)]
    scalars: dict[str, Any] = {}
    if opt.piece_params:  # not per element (Adam's step): the same in every piece
        state = opt.optimizer.state.get(opt.piece_params[0], {})
        scalars = {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}
    return {"meta/format": FORMAT, "meta/groups": groups, "meta/scalar_state": scalars}


def save_sharded(path: str | os.PathLike, model: nn.Module, opt: ZeroOptimizer,
                 shard_key: str | None = None) -> None:
    """Every rank writes its shards (collective over the optimizer's group; over the
    world for a tensor-parallel model). See the module docstring for ``shard_key``."""
    opt._refuse_offload("save_sharded", state_only=True)  # its state is not in memory
    where = _where(path, opt, shard_key)
    names = opt.param_names(model)
    state = {**_tensors(model, opt, names, where), **_objects(opt, names)}
    dcp_chunks.save(state, where.folder, where.group)


def _open(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's keys ((shape, dtype), None for an object) and its ``meta/``
    objects, checked: they are read from files, not trusted."""
    saved = dcp_chunks.saved_keys(folder)
    if missing := [k for k in META if k not in saved or saved[k] is not None]:
        raise ValueError(f"{folder}: not a pycomm ZeRO checkpoint (no {', '.join(missing)})")
    meta = dcp_chunks.read_whole(folder, list(META))
    if meta["meta/format"] != FORMAT:
        raise ValueError(f"{folder}: format {meta['meta/format']!r}, expected {FORMAT!r}")
    groups = meta["meta/groups"]
    if not (isinstance(groups, list) and isinstance(meta["meta/scalar_state"], dict) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and isinstance(g.get("options"), dict) for g in groups)):
        raise ValueError(f"{folder}: malformed ZeRO checkpoint (its parameter groups or "
                         "scalar optimizer state)")
    return saved, meta


def _check_model(where: _Where, saved: dict[str, Any], model: nn.Module, opt: ZeroOptimizer,
                 names: list[str]) -> None:
    """The same parameter and buffer names and (whole) shapes as the checkpoint's."""
    mine = {f"param/{n}": tuple(whole_shape(s, p, where.tp))
            for n, s, p in zip(names, opt.param_shapes(), opt.params, strict=True)}
    mine.update({f"buffer/{n}": tuple(b.shape) for n, b in _buffers(model, names).items()})
    theirs = {k: tuple(v[0]) for k, v in saved.items()
              if k.startswith(("param/", "buffer/")) and v is not None}
    if mine != theirs:
        only_saved = sorted(f"{k} {v}" for k, v in theirs.items() if mine.get(k) != v)
        only_here = sorted(f"{k} {v}" for k, v in mine.items() if theirs.get(k) != v)
        raise ValueError(f"{where.folder}: checkpoint is from a different model; it holds "
                         f"{len(only_saved)} entries this model does not (such as "
                         f"{only_saved[:3]}), this model {len(only_here)} it does not "
                         f"(such as {only_here[:3]})")


def _check_groups(folder: Path, saved: list[dict[str, Any]], opt: ZeroOptimizer,
                  names: list[str]) -> None:
    """The same parameter groups, each of the same parameters (by name)."""
    if len(saved) != len(opt.group_params):
        raise ValueError(f"{folder}: the checkpoint has {len(saved)} parameter groups, the "
                         f"optimizer {len(opt.group_params)}")
    for n, (group, ids) in enumerate(zip(saved, opt.group_params, strict=True)):
        theirs, mine = set(map(str, group["params"])), {names[i] for i in ids}
        if theirs != mine:
            raise ValueError(f"{folder}: parameter group {n} differs: only the checkpoint's "
                             f"has {sorted(theirs - mine)[:3]}, only the optimizer's "
                             f"{sorted(mine - theirs)[:3]}")


def _restore_scalars(opt: ZeroOptimizer, scalars: dict[str, Any], has_state: bool) -> None:
    """Every piece's scalar state (Adam's step), each its own copy (optimizers count in
    place); no state at all when the checkpoint has none (saved before the first step)."""
    for q in opt.piece_params:
        if not has_state:
            opt.optimizer.state.pop(q, None)
        elif scalars:
            opt.optimizer.state[q].update({k: v.clone() if torch.is_tensor(v) else v
                                           for k, v in scalars.items()})


def load_sharded(path: str | os.PathLike, model: nn.Module, opt: ZeroOptimizer,
                 shard_key: str | None = None) -> None:
    """Restore parameters, this rank's optimizer state, the groups' hyper-parameters
    and the buffers, whatever data-parallel world size, stage or TP size saved them
    (collective as :func:`save_sharded`).

    Raises:
        ValueError: on every rank, before any value is overwritten (a fresh optimizer's
            state may have been made), when the checkpoint is of another model
            (parameter or buffer names or shapes), has other parameter groups, or lacks
            state this optimizer keeps (named in the message).
    """
    opt._refuse_offload("load_sharded", state_only=True)

    where = _where(path, opt, shard_key)
    names = opt.param_names(model)
    saved, meta = _open(where.folder)
    _check_model(where, saved, model, opt, names)
    _check_groups(where.folder, meta["meta/groups"], opt, names)
    has_state = any(k.startswith("optim/") for k in saved)
    if has_state:
        ensure_state(opt.optimizer)  # tensors to read into, in place
    tensors = {k: v for k, v in _tensors(model, opt, names, where).items()
               if has_state or not k.startswith("optim/")}
    dcp_chunks.load(tensors, where.folder, where.group)
    _restore_scalars(opt, meta["meta/scalar_state"], has_state)
    for group, saved_group in zip(opt.param_groups, meta["meta/groups"], strict=True):
        group.update(options(saved_group["options"]))  # the inner groups follow at step
    opt.publish_shards()  # every rank's masters into the (compute-dtype) parameters


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A plain, full ``state_dict`` (parameters whole, and buffers), in one process
    without any process group."""
    saved, _ = _open(Path(path))
    keys = [k for k in saved if k.startswith(("param/", "buffer/"))]
    return {k.partition("/")[2]: v for k, v in dcp_chunks.read_whole(path, keys).items()}
