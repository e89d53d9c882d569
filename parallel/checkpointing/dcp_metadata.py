"""A checkpoint's metadata read as untrusted input: DCP unpickles ``.metadata`` with plain
``pickle``; here it is unpickled through an allow list of DCP's own metadata classes,
and checked (every storage entry a file inside the checkpoint, every chunk inside its
tensor) before any of it is used."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .chunks import inside, show

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_META, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only its own classes and torch dtypes may load."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: Path) -> Metadata:
    """The checked metadata of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no complete checkpoint there (say so when a partial one is).
        ValueError: the metadata is malformed or a chunk lies outside its tensor.
    """
    if not (path / ".metadata").is_file():
        partial = path.with_name(path.name + ".partial")
        hint = f" ({partial} is a save that did not finish)" if partial.exists() else ""
        raise FileNotFoundError(f"no checkpoint at {path}{hint}")
    try:
        with open(path / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as exc:  # whatever a malformed pickle raises
        raise ValueError(f"{path}: unreadable checkpoint metadata ({exc})") from exc
    if not (isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        raise ValueError(f"{path}: not a checkpoint's metadata")
    for index, info in md.storage_data.items():
        _check_storage(path, index, info)
    for key, smd in md.state_dict_metadata.items():
        _check_entry(path, key, smd, md.storage_data)
    return md


def _check_storage(path: Path, index: Any, info: Any) -> None:
    """A storage entry names a file inside the checkpoint and a byte range."""
    ok = (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
          and isinstance(info.relative_path, str)
          and info.relative_path not in ("", ".", "..")
          and os.path.basename(info.relative_path) == info.relative_path
          and all(type(v) is int and v >= 0 for v in (info.offset, info.length))
          and not getattr(info, "transform_descriptors", None))  # save writes none
    if not ok:
        raise ValueError(f"{path}: malformed storage entry {index!r}: {info!r}")


def _check_entry(path: Path, key: Any, smd: Any, storage: dict) -> None:
    """A key's entry is an object, or a tensor whose chunks lie inside it and are stored."""
    if isinstance(smd, BytesStorageMetadata) and isinstance(key, str):
        if MetadataIndex(key) not in storage:
            raise ValueError(f"{path}: key {key!r}: the object is not stored")
        return
    if not (isinstance(key, str) and isinstance(smd, TensorStorageMetadata)
            and isinstance(smd.size, torch.Size)
            and all(type(v) is int and v >= 0 for v in smd.size)
            and isinstance(smd.properties, TensorProperties)
            and isinstance(smd.properties.dtype, torch.dtype)
            and isinstance(smd.chunks, list)
            and all(isinstance(c, ChunkStorageMetadata) for c in smd.chunks)):
        raise ValueError(f"{path}: key {key!r}: malformed entry")
    for c in smd.chunks:
        if not inside(smd.size, c.offsets, c.sizes):
            raise ValueError(f"{path}: key {key!r}: saved chunk at {show(c.offsets)} of "
                             f"size {show(c.sizes)} lies outside shape {tuple(smd.size)}")
        if MetadataIndex(key, c.offsets) not in storage:
            raise ValueError(f"{path}: key {key!r}: chunk at {tuple(c.offsets)} not stored")


class Reader(FileSystemReader):
    """DCP's file reader with the metadata read once, through :func:`_read_metadata`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata = read_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


# --- load -------------------------------------------------------------------------------
