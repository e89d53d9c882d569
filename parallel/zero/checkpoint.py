"""Sharded checkpoints of ZeRO training that reload onto any world size.

Each data-parallel rank writes ``rank{r}.pt`` holding, for every parameter it owns elements of, the
range ``[lo, hi)`` of the flattened parameter, its values there, and the optimizer state
tensors for the same elements. Ranges, not bucket shards, are the unit, so a job with a
different world size (a different layout) can find the elements it owns in any file.
``meta.pt`` (rank 0) holds the names, shapes, world size, hyper-parameters, scalar
optimizer state and the model's buffers.

A tensor-parallel model (its parameters marked by
:func:`parallel.tensor.apply_tensor_parallel`) holds different tensors under the same
names on each tensor-parallel rank: each of those ranks writes into its own folder,
``tp{t}-of-{T}/``, with the parameters' splits in its ``meta.pt``, so
:func:`consolidate` can rebuild every parameter whole. Other model-parallel layouts (a
pipeline stage) pass their own ``shard_key``; parallel.compose.checkpoint does this for a
composed job.

Example::

    save_sharded("ckpt/step10", model, opt)        # every rank
    load_sharded("ckpt/step10", model, opt)        # every rank, any world size
    full = consolidate("ckpt/step10")              # no process group needed
    plain_model.load_state_dict(full)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.tensor.sharding import TPSpec, model_parallel_groups, spec_of
from parallel.zero.param_groups import options
from parallel.zero.zero_optimizer import ZeroOptimizer

FORMAT = "pycomm.zero/1"


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


def _scalar_state(opt: ZeroOptimizer) -> dict[str, Any]:
    """The state that is not per element (Adam's step count), from the first piece."""
    if not opt.piece_params:
        return {}
    state = opt.optimizer.state.get(opt.piece_params[0], {})
    return {key: t for key, t in state.items() if not (torch.is_tensor(t) and t.dim() > 0)}


def shard_folder(path: str | os.PathLike, opt: ZeroOptimizer, shard_key: str | None) -> Path:
    """Where this rank's files go: ``path``, or its model-parallel position's sub-folder
    (``shard_key``, else ``tp{t}-of-{T}`` for a tensor-parallel model)."""
    if shard_key is None:
        groups = model_parallel_groups(opt.params)
        if len(groups) > 1:
            raise ValueError("save_sharded: the parameters lie in several tensor-parallel "
                             "groups; pass shard_key to name this rank's position")
        if groups:
            group: Any = groups[0]
            shard_key = f"tp{dist.get_rank(group)}-of-{dist.get_world_size(group)}"
    if shard_key is not None and (not shard_key or "/" in shard_key or shard_key[0] == "."):
        raise ValueError(f"save_sharded: shard_key {shard_key!r} is not a plain folder name")
    return Path(path) / shard_key if shard_key else Path(path)


def save_sharded(path: str | os.PathLike, model: nn.Module, opt: ZeroOptimizer,
                 shard_key: str | None = None) -> None:
    """Every rank writes its shard (collective over the optimizer's group: all its ranks
    call it). See the module docstring for ``shard_key``."""
    path = shard_folder(path, opt, shard_key)
    path.mkdir(parents=True, exist_ok=True)
    names = opt.param_names(model)
    pieces = {}
    for i, k, lo, hi, at in owned_pieces(opt):
        shard = opt.shard_params[k].detach()
        state = {key: t.clone() for key, t in state_slices(opt, k, at, hi - lo).items()}
        pieces[names[i]] = {"lo": lo, "hi": hi, "value": shard[at : at + hi - lo].clone(),
                            "state": state}
    torch.save({"format": FORMAT, "pieces": pieces}, path / f"rank{opt.rank}.pt")
    if opt.rank == 0:
        torch.save(_meta(model, opt, names), path / "meta.pt")
    dist.barrier(opt.group)  # the checkpoint is complete only once every rank wrote


def _meta(model: nn.Module, opt: ZeroOptimizer, names: list[str]) -> dict[str, Any]:
    params = set(names)
    return {
        "format": FORMAT,
        "world": opt.world,
        "shapes": dict(zip(names, map(tuple, opt.param_shapes()), strict=True)),
        "dtype": str(opt.precision.master),
        "param_groups": [options(g) for g in opt.param_groups],
        "scalar_state": _scalar_state(opt),
        "buffers": _buffers(model, params),
        "splits": {n: (spec_of(p).dim, spec_of(p).interleave)
                   for n, p in zip(names, opt.params, strict=True)},
    }


def _buffers(model: nn.Module, params: set[str]) -> dict[str, torch.Tensor]:
    """The state that is not a parameter (stage 3's shards are parameters too)."""
    state = model.state_dict(keep_vars=True)
    return {n: t.detach() for n, t in state.items()
            if n not in params and not isinstance(t, nn.Parameter)}


def _load_meta(path: Path) -> dict[str, Any]:
    meta = torch.load(path / "meta.pt", weights_only=False)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a pycomm ZeRO checkpoint (format {meta.get('format')!r})")
    return meta


def _all_pieces(path: Path, world: int) -> list[dict[str, Any]]:
    files = [path / f"rank{r}.pt" for r in range(world)]
    if missing := [str(f) for f in files if not f.exists()]:
        raise FileNotFoundError(f"incomplete ZeRO checkpoint {path}: missing {missing}")
    return [torch.load(f, mmap=True, weights_only=False)["pieces"] for f in files]


def load_sharded(path: str | os.PathLike, model: nn.Module, opt: ZeroOptimizer,
                 shard_key: str | None = None) -> None:
    """Restore parameters, this rank's optimizer state and hyper-parameters, whatever
    data-parallel world size saved them (the model-parallel layout must be the same).

    Raises:
        ValueError: if the checkpoint's parameter names or shapes differ from the model's.
    """
    path = shard_folder(path, opt, shard_key)
    meta = _load_meta(path)
    names = opt.param_names(model)
    shapes = dict(zip(names, map(tuple, opt.param_shapes()), strict=True))
    if shapes != meta["shapes"]:
        diff = sorted(set(shapes.items()) ^ set(meta["shapes"].items()))[:4]
        raise ValueError(f"{path}: checkpoint is from a different model; differing "
                         f"(name, shape) entries include {diff}")
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"{path}: checkpoint has {len(meta['param_groups'])} parameter "
                         f"groups, the optimizer {len(opt.param_groups)}")
    files = _all_pieces(path, meta["world"])
    with torch.no_grad():
        _restore_values(opt, names, files)
        _restore_state(opt, names, files, meta)
    for group, saved in zip(opt.param_groups, meta["param_groups"], strict=True):
        group.update(saved)  # the inner optimizer's groups follow at the next step
    model.load_state_dict(meta["buffers"], strict=False)


def _restore_values(opt: ZeroOptimizer, names: list[str], files: list[dict]) -> None:
    """This rank's shards, element range by element range; then every rank's shards
    into the parameters (stages 1-2: whole on every rank; stage 3: gathered when used)."""
    for i, k, lo, hi, at in owned_pieces(opt):
        shard = opt.shard_params[k].detach()
        for piece, a, b in _overlapping(files, names[i], lo, hi):
            value = piece["value"][a - piece["lo"] : b - piece["lo"]]
            shard[at + a - lo : at + b - lo].copy_(value)
    opt.publish_shards()


def _overlapping(files: list[dict], name: str, lo: int,
                 hi: int) -> Iterator[tuple[dict[str, Any], int, int]]:
    """Each saved piece of ``name`` that overlaps ``[lo, hi)``, with the overlap."""
    for pieces in files:
        piece = pieces.get(name)
        if piece is not None and piece["hi"] > lo and piece["lo"] < hi:
            yield piece, max(lo, piece["lo"]), min(hi, piece["hi"])


def _restore_state(opt: ZeroOptimizer, names: list[str], files: list[dict],
                   meta: dict[str, Any]) -> None:
    """This rank's optimizer state, gathered element range by element range."""
    keys = {key for pieces in files for piece in pieces.values() for key in piece["state"]}
    for param in opt.piece_params:  # every piece, even one holding only padding
        state = opt.optimizer.state.setdefault(param, {})
        for key in keys:
            state[key] = torch.zeros_like(param)
        for key, value in meta["scalar_state"].items():
            state[key] = value.clone() if torch.is_tensor(value) else value
    for i, k, lo, hi, at in owned_pieces(opt):
        state = state_slices(opt, k, at, hi - lo)
        for piece, a, b in _overlapping(files, names[i], lo, hi):
            for key, saved in piece["state"].items():
                src = saved[a - piece["lo"] : b - piece["lo"]]
                state[key][a - lo : b - lo].copy_(src)


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A plain, full ``state_dict`` (parameters and buffers), without any process group:
    tensor-parallel folders (``tp{t}-of-{T}``) are joined along each parameter's split."""
    path = Path(path)
    if (path / "meta.pt").exists():
        return _consolidate_folder(path)
    folders = sorted(path.glob("tp*-of-*"), key=lambda f: int(f.name[2:].partition("-")[0]))
    sizes = {f.name.rpartition("-")[2] for f in folders}
    if not folders or len(sizes) != 1 or len(folders) != int(sizes.pop()):
        raise FileNotFoundError(f"{path}: no meta.pt, and not one complete set of "
                                f"tensor-parallel folders (found {[f.name for f in folders]})")
    parts = [_consolidate_folder(f) for f in folders]
    splits = _load_meta(folders[0]).get("splits", {})
    return {name: TPSpec(*splits[name]).unshard([p[name] for p in parts]) if name in splits
            else value for name, value in parts[0].items()}


def _consolidate_folder(path: Path) -> dict[str, torch.Tensor]:
    meta = _load_meta(path)
    dtype = getattr(torch, meta["dtype"].removeprefix("torch."))
    full = {n: torch.zeros(shape, dtype=dtype) for n, shape in meta["shapes"].items()}
    for pieces in _all_pieces(path, meta["world"]):
        for name, piece in pieces.items():
            full[name].view(-1)[piece["lo"] : piece["hi"]].copy_(piece["value"])
    return {**full, **meta["buffers"]}
