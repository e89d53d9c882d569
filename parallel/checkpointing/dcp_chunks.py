"""Sharded checkpoints on torch.distributed.checkpoint (DCP): each rank writes only the
pieces it holds, no rank gathers a whole tensor, and any layout loads any other.

A rank's piece of a tensor is a :class:`ChunkedTensor`: the global shape and a few
rectangular :class:`Chunk` s in global coordinates, whose data are views into the live
buffers (a ZeRO shard of a tensor-parallel part; :func:`chunks_of` builds them). DCP
writes the chunks (replicated ones, same key and offsets on several ranks, once) and on
load intersects the saved chunks with the wanted ones, so resharding is DCP's overlap
arithmetic. What is read back is untrusted: the metadata is unpickled through an allow
list and checked (every chunk inside its tensor, every wanted element covered exactly
once) before anything is written. Example::

    flat = tp_part.view(-1)[s:s + n]          # this rank's ZeRO shard of its TP part
    w = ChunkedTensor(shape, flat.dtype, chunks_of(shape, spec, tp, tp_rank, flat, s))
    save({"w": w, "step": 7}, "ckpt/step7")   # collective
    load({"w": w, "step": None}, "ckpt/step7")  # fills flat in place; returns {"step": 7}
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .chunks import (
    Box,
    Chunk,
    ChunkedTensor,
    as_chunked,
    chunks_of,
    describe,
    disjoint,
    inside,
)
from .dcp_metadata import Reader, read_metadata

__all__ = ["Chunk", "ChunkedTensor", "chunks_of", "load", "payload_by_file", "read_whole",
           "save", "saved_keys"]

Release = Callable[[torch.Tensor, bool], None]  # (view, written): see save's ``release``


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# --- save -------------------------------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """One write item per non-empty chunk (DCP dedups identical ones across ranks); the
    coordinator checks that ranks agree on each key and that the chunks tile each tensor."""

    def __init__(self, state: dict[str, Any], release: Release | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._state, self._release = state, release

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        # DCP is handed only the keys: it would turn objects with a state_dict() method
        # into their state dicts; the planner writes the values as given.
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict = self._state

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        kinds: dict[str, tuple[torch.Size, torch.dtype] | None] = {}
        self._data: dict[MetadataIndex, torch.Tensor] = {}
        for key, value in self.state_dict.items():
            ct = as_chunked(key, value)
            kinds[key] = None if ct is None else (ct.shape, ct.dtype)
            if ct is None:
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            pieces = [(c.offsets, c.data) for c in ct.chunks if c.data.numel()]
            if not ct.shape.numel():  # nothing to hold, but the key must exist
                pieces = [((0,) * len(ct.shape), torch.empty(ct.shape, dtype=ct.dtype))]
            for offsets, data in pieces:
                index = MetadataIndex(key, offsets)
                self._data[index] = data.detach()
                items.append(_write_item(index, ct, data.shape))
        self.plan = SavePlan(items, planner_data=kinds)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        kinds = _agreed_kinds(all_plans)
        plans, metadata = super().create_global_plan(all_plans)
        _check_tiling(kinds, metadata)
        return plans, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.offset is None:
            return self.state_dict[index.fqn]
        data = self._data[index]
        if self._release is None:
            return data
        copy = data.clone()  # the chunk's own memory, then its source's pages let go
        self._release(data, False)
        return copy


def _write_item(index: MetadataIndex, ct: ChunkedTensor, sizes: torch.Size) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(index.offset or ()), sizes=sizes)
    return WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
        chunk=chunk, properties=TensorProperties(dtype=ct.dtype), size=ct.shape))


def _agreed_kinds(plans: list[SavePlan]) -> dict[str, Any]:
    """Each key's (shape, dtype) or None (object), the same on every rank holding it, and
    replicated chunks (same key and offsets) of the same size everywhere."""
    kinds: dict[str, Any] = {}
    sizes: dict[MetadataIndex, torch.Size] = {}
    for rank, plan in enumerate(plans):
        for key, kind in plan.planner_data.items():
            if kinds.setdefault(key, kind) != kind:
                raise ValueError(f"key {key!r}: ranks disagree on what it is ({_kind(kind)} "
                                 f"on rank {rank}, {_kind(kinds[key])} on another)")
        for item in plan.items:
            if item.tensor_data and sizes.setdefault(
                    item.index, item.tensor_data.chunk.sizes) != item.tensor_data.chunk.sizes:
                raise ValueError(f"key {item.index.fqn!r}: ranks hold chunks at "
                                 f"{tuple(item.index.offset or ())} of different sizes")
    return kinds


def _kind(kind: Any) -> str:
    return "an object" if kind is None else "a " + describe(*kind)


def _check_tiling(kinds: dict[str, Any], metadata: Metadata) -> None:
    """Every tensor key's saved chunks lie inside it and add up to it (DCP's own global
    check adds: they do not overlap)."""
    for key, kind in kinds.items():
        md = metadata.state_dict_metadata.get(key)
        if kind is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"key {key!r}: no rank holds any part of it")
        for c in md.chunks:
            if not inside(md.size, c.offsets, c.sizes):
                raise ValueError(f"key {key!r}: chunk at {tuple(c.offsets)} of size "
                                 f"{tuple(c.sizes)} lies outside shape {tuple(md.size)}")
        held = sum(math.prod(c.sizes) for c in md.chunks)
        if md.size.numel() and held != md.size.numel():
            raise ValueError(f"key {key!r}: the ranks' chunks hold {held} elements of "
                             f"{md.size.numel()} (a part is missing or held twice)")


def save(state: dict[str, Any], path: str | os.PathLike, group: Any = None,
         release: Release | None = None) -> None:
    """Write ``state`` to the directory ``path``, each rank only its chunks. Collective
    over ``group`` (default: the world; a single process without a process group).

    Args:
        state: key -> :class:`ChunkedTensor`, plain tensor (whole, equal on every rank
            that has the key: one copy is written) or picklable object (likewise).
        path: the checkpoint directory. It is written as ``<path>.partial`` and renamed
            once every rank has written, replacing an older ``path``: a directory named
            ``path`` is always complete.
        group: the process group of the ranks that save.
        release: for chunks that are views of files (an offloaded job's unit store):
            ``release(view, written)`` lets the view's pages go once it was copied
            (save) or written (load, ``written``: flushed first). Each chunk is then
            copied when written, into a file of its own, so at most one chunk is in
            memory at a time (DCP keeps every tensor of a file until the file is
            written; the views would otherwise all come in at once).

    Raises:
        ValueError: a chunk does not fit its tensor, ranks disagree on a key's shape or
            dtype, or the ranks' chunks do not tile a tensor (named in the message).
    """
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    lead = not _distributed() or dist.get_rank(group) == 0
    if lead:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(group)
    try:
        with warnings.catch_warnings():  # DCP warns that one process is one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            writer = FileSystemWriter(partial, single_file_per_rank=release is None)
            dcp.save(dict.fromkeys(state), storage_writer=writer,
                     planner=_SavePlanner(state, release), process_group=group,
                     no_dist=not _distributed())
    except CheckpointException as exc:
        raise _unwrapped(exc, f"saving {final}") from None
    _barrier(group)  # every rank has written: now the directory is complete
    if lead:
        _replace(partial, final)
    _barrier(group)


def _replace(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final``; an older ``final`` is moved aside first, so that
    some complete checkpoint exists at every moment."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _barrier(group: Any) -> None:
    if _distributed():
        dist.barrier(group=group)


def _unwrapped(exc: CheckpointException, what: str) -> BaseException:
    """DCP's collected failures (a BaseException) as one ValueError when they are checks
    (ours, or ``weights_only`` refusing an object), else as they are."""
    errors = [err for err, _trace in exc.failures.values()]
    if not all(isinstance(err, (ValueError, pickle.UnpicklingError)) for err in errors):
        return exc
    return ValueError(f"{what}: " + "; ".join(sorted({str(err) for err in errors})))


# --- reading the metadata, untrusted -----------------------------------------------------

class _LoadPlanner(DefaultLoadPlanner):
    """Reads what :func:`_plan_reads` planned into the chunks' data, in place, and
    unpickles the objects (``weights_only`` unless told otherwise: the files are data)."""

    def __init__(self, items: list[ReadItem], targets: dict[str, list[torch.Tensor]],
                 weights_only: bool, release: Release | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._targets, self._weights_only = items, targets, weights_only
        self._release = release
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # Not DefaultLoadPlanner's: it rewrites state-dict values it does not know.
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._targets[index.fqn][index.index or 0]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self._release is not None:  # written: flushed, and its pages let go
            self._release(tensor, True)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = torch.load(value, weights_only=self._weights_only)
        self.objects[read_item.dest_index.fqn] = obj


def _plan_reads(state: dict[str, Any], md: Metadata) -> tuple[
        list[ReadItem], dict[str, list[torch.Tensor]], list[str]]:
    """The reads that fill ``state`` from the checkpoint, the tensors they land in (per
    key, in chunk order: a read's ``dest_index.index``), and what stands in the way."""
    items: list[ReadItem] = []
    targets: dict[str, list[torch.Tensor]] = {}
    problems: list[str] = []
    for key, value in state.items():
        try:
            wanted = as_chunked(key, value)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        smd = md.state_dict_metadata.get(key)
        problem = _mismatch(key, wanted, smd)
        if problem:
            problems.append(problem)
        elif wanted is None or not isinstance(smd, TensorStorageMetadata):
            items.append(_object_read(key))  # (no mismatch: both are objects)
        else:
            chunks = [c for c in wanted.chunks if c.data.numel()]
            targets[key] = [c.data.detach() for c in chunks]
            local = [ChunkStorageMetadata(torch.Size(c.offsets), c.data.shape) for c in chunks]
            # DCP's overlap arithmetic: one read per (wanted, saved) chunk pair that meet
            reads = [r for r in create_read_items_for_chunk_list(key, smd, local)
                     if math.prod(r.lengths)]
            problems += _uncovered(key, local, reads)
            items += reads
    return items, targets, problems


def _mismatch(key: str, wanted: ChunkedTensor | None, smd: Any) -> str | None:
    """Why the saved entry cannot fill the wanted value, or None."""
    if smd is None:
        return f"key {key!r} is not in the checkpoint"
    saved = None if isinstance(smd, BytesStorageMetadata) else (smd.size, smd.properties.dtype)
    here = None if wanted is None else (wanted.shape, wanted.dtype)
    if saved != here:
        return f"key {key!r}: the checkpoint holds {_kind(saved)}, this rank wants {_kind(here)}"
    return None


def _object_read(key: str) -> ReadItem:
    zero = torch.Size((0,))
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=zero,
                    storage_index=MetadataIndex(key), storage_offsets=zero, lengths=zero)


def _uncovered(key: str, local: list[ChunkStorageMetadata], reads: list[ReadItem]) -> list[str]:
    """The wanted chunks that the reads do not fill exactly once (saved chunks missing or
    overlapping: the metadata is not trusted to tile the tensor)."""
    boxes: dict[int, list[Box]] = defaultdict(list)
    for r in reads:
        boxes[r.dest_index.index or 0].append((tuple(r.dest_offsets), tuple(r.lengths)))
    out = []
    for i, c in enumerate(local):
        got = boxes[i]
        if sum(math.prod(s) for _, s in got) != c.sizes.numel() or not disjoint(got):
            out.append(f"key {key!r}: the checkpoint does not hold the part at "
                       f"{tuple(c.offsets)} of size {tuple(c.sizes)} exactly once")
    return out


def load(state: dict[str, Any], path: str | os.PathLike, group: Any = None, *,
         weights_only: bool = True, release: Release | None = None) -> dict[str, Any]:
    """Fill ``state`` from the checkpoint at ``path``, saved in any layout. Collective
    over ``group`` (default: the world; a single process without a process group).

    Args:
        state: key -> :class:`ChunkedTensor` (its chunks' data are written in place),
            plain tensor (written in place, whole) or anything else (an object to read;
            the value is ignored).
        path: a directory written by :func:`save`.
        group: the process group of the ranks that load.
        weights_only: unpickle objects with ``torch.load(weights_only=True)``'s allow
            list (plain containers, numbers, strings, tensors); False trusts the files.
        release: as for :func:`save`, called on each chunk once it is written.

    Returns: key -> loaded value, for the object entries.

    Raises:
        ValueError: on every rank, naming each key (and rank) at fault, when there is no
            complete checkpoint at ``path``, a key is missing from it, a saved shape,
            dtype or kind differs from the wanted one, or the saved chunks do not cover a
            wanted chunk exactly once. Nothing has been written then.
    """
    return _load(state, path, group, weights_only, multi=_distributed(), release=release)


def _load(state: dict[str, Any], path: str | os.PathLike, group: Any, weights_only: bool,
          multi: bool, release: Release | None = None) -> dict[str, Any]:
    """:func:`load`, collective when ``multi``, else in this process alone."""
    reader: Reader | None = None
    items: list[ReadItem] = []
    targets: dict[str, list[torch.Tensor]] = {}
    try:
        reader = Reader(Path(path))
        items, targets, problems = _plan_reads(state, reader.metadata)
    except Exception as exc:  # any rank's: every rank must still reach _everyones
        plain = isinstance(exc, (FileNotFoundError, ValueError))
        problems = [str(exc) if plain else repr(exc)]
    if multi:
        problems = _everyones(problems, group)
    if problems or reader is None:
        raise ValueError(f"cannot load {path}:\n  " + "\n  ".join(problems))
    planner = _LoadPlanner(items, targets, weights_only, release)
    try:
        with warnings.catch_warnings():  # as in save
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(dict.fromkeys(state), storage_reader=reader, planner=planner,
                     process_group=group, no_dist=not multi)
    except CheckpointException as exc:
        raise _unwrapped(exc, f"loading {path}") from None
    return planner.objects


def _everyones(problems: list[str], group: Any) -> list[str]:
    """Every rank's problems, each once, with the (group) ranks that have it."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    ranks: dict[str, list[int]] = defaultdict(list)
    for rank, theirs in enumerate(gathered):
        for p in theirs:
            ranks[p].append(rank)
    return [f"{p} (rank {', '.join(map(str, r))})" for p, r in ranks.items()]


def saved_keys(path: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """Each saved key's global (shape, dtype), None for an object; no process group.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: its metadata is malformed.
    """
    md = read_metadata(Path(path))
    return {k: (v.size, v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in md.state_dict_metadata.items()}


def read_whole(path: str | os.PathLike, keys: list[str] | None = None, *,
               weights_only: bool = True) -> dict[str, Any]:
    """Whole tensors (and the objects) of a checkpoint, assembled in this one process
    from every rank's chunks, without a process group: consolidation.

    Args:
        path: a directory written by :func:`save`.
        keys: the keys to read (default: all).
        weights_only: as for :func:`load`.

    Raises:
        ValueError: a key is not in the checkpoint, or the chunks do not tile a tensor.
        FileNotFoundError: no complete checkpoint at ``path``.
    """
    saved = read_metadata(Path(path)).state_dict_metadata
    wanted = list(saved) if keys is None else list(keys)
    whole: dict[str, Any] = {}
    for key in wanted:
        md = saved.get(key)
        if isinstance(md, TensorStorageMetadata):
            whole[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            whole[key] = None  # an object (or a missing key, which load names)
    objects = _load(whole, path, None, weights_only, multi=False)
    return {k: objects[k] if v is None else v for k, v in whole.items()}


def payload_by_file(path: str | os.PathLike) -> dict[str, int]:
    """Bytes of tensor data each file of the checkpoint holds (the chunks DCP assigned to
    it, without its per-item framing): every element of every tensor is in exactly one
    file, so the sum is the tensors' size once, whatever the replication when saved."""
    md = read_metadata(Path(path))
    out: dict[str, int] = defaultdict(int)
    for key, smd in md.state_dict_metadata.items():
        if not isinstance(smd, TensorStorageMetadata):
            continue
        item = torch.empty((), dtype=smd.properties.dtype).element_size()
        for chunk in smd.chunks:
            index = MetadataIndex(key, chunk.offsets)
            out[md.storage_data[index].relative_path] += math.prod(chunk.sizes) * item
    return dict(out)
