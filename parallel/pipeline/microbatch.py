"""Splitting a mini-batch into micro-batches along dimension 0.

Tensors are split with ``torch.tensor_split`` (a batch of 10 in 4 chunks gives 3, 3, 2,
2 rows); tuples, lists and dicts are split member by member; anything else (a flag, a
config) is passed to every micro-batch unchanged. Layers that compute statistics over
the batch (batch norm) see micro-batches, not the mini-batch: their results differ from
the unpartitioned model's, as in GPipe.

The first stage's first layer receives each micro-batch as one object (a tensor, or a
tuple or dict of them), as ``nn.Sequential`` passes it.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch


def batch_size(batch: Any) -> int | None:
    """Rows of the first tensor found in ``batch`` (None: no tensor)."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else None
    members = batch.values() if isinstance(batch, dict) else batch
    if isinstance(batch, (tuple, list, dict)):
        for item in members:
            if (rows := batch_size(item)) is not None:
                return rows
    return None


def shape_signature(batch: Any) -> int:
    """A number that is equal for batches whose tensors have equal shapes and dtypes."""
    parts: list[str] = []

    def visit(item: Any) -> None:
        if torch.is_tensor(item):
            parts.append(f"{tuple(item.shape)}{item.dtype}")
        elif isinstance(item, (tuple, list)):
            for x in item:
                visit(x)
        elif isinstance(item, dict):
            for k in sorted(item, key=str):
                parts.append(str(k))
                visit(item[k])

    visit(batch)
    return zlib.crc32(";".join(parts).encode())


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """``chunks`` micro-batches of ``batch`` (see the module docstring)."""
    if torch.is_tensor(batch) and batch.dim():
        return list(torch.tensor_split(batch, chunks, dim=0))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(item, chunks) for item in batch]
        return [type(batch)(p[m] for p in parts) for m in range(chunks)]
    if isinstance(batch, dict):
        parts_by_key = {k: split_batch(v, chunks) for k, v in batch.items()}
        return [{k: p[m] for k, p in parts_by_key.items()} for m in range(chunks)]
    return [batch] * chunks
