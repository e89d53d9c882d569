"""Filters on pushes (Li et al., OSDI 2014, §5.2): a worker drops insignificant rows and
compresses values before sending; the server decodes what arrives.

Two kinds. :class:`SignificanceFilter` keeps back rows whose largest magnitude is below a
threshold and adds them to that key's next push (error feedback), so no gradient mass is
lost, only delayed. :func:`encode` / :func:`decode` are the value codecs: ``none`` (raw
float32), ``fp16``, ``bf16`` and ``int8`` with one float32 scale per block of elements.
Frames are raw buffers (no pickling): a peer is untrusted, so :func:`decode` checks every
frame's size against the meta before it reads a byte.

Example::

    keys, values = SignificanceFilter(1e-3)("emb", keys, grads)
    frames, meta = encode(values, "int8")   # send frames + json.dumps(meta)
    values = decode(frames, meta)           # on the server
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias

from .._optional import missing

try:
    import numpy as np
except ModuleNotFoundError as err:
    raise missing("numpy", "pycomm.parallel.ps (the parameter server's codecs)", err) from err
import torch

Tensor = torch.Tensor
Frame: TypeAlias = bytes | bytearray | memoryview
CODECS = ("none", "fp16", "bf16", "int8")


def _check_push(table: str, keys: Tensor, values: Tensor) -> None:
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"table {table!r}: keys must be 1-D int64, got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    if values.dtype != torch.float32 or values.dim() != 2 or values.shape[0] != keys.numel():
        raise ValueError(f"table {table!r}: values must be float32 of shape ({keys.numel()}, d) "
                         f"for {keys.numel()} keys, got {values.dtype} {tuple(values.shape)}")
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        raise ValueError(f"table {table!r}: keys must be sorted and unique")


def _find(sorted_keys: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """(positions, found): where each of keys sits in sorted_keys, and whether it is there."""
    if sorted_keys.numel() == 0:
        return torch.zeros_like(keys), torch.zeros(keys.shape, dtype=torch.bool)
    pos = torch.searchsorted(sorted_keys, keys).clamp_(max=sorted_keys.numel() - 1)
    return pos, sorted_keys[pos] == keys


class SignificanceFilter:
    """Drop rows whose largest |value| is below threshold; what is dropped is kept and added
    to the row's next push (error feedback), so no gradient mass is ever lost.

    Residuals are per (table, key). Call :meth:`flush` at the end to send what is held.

    Args:
        threshold: finite, >= 0; a row is sent when max |value| >= threshold (0 sends all).
    """

    def __init__(self, threshold: float) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"SignificanceFilter: threshold must be a finite number >= 0, "
                             f"got {threshold!r}")
        self.threshold = float(threshold)
        self._held: dict[str, tuple[Tensor, Tensor]] = {}  # table -> sorted keys, rows

    def __call__(self, table: str, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The rows to send: those significant once the residual held for their key is added.

        Args:
            table: the table's name; residuals of different tables never mix.
            keys: int64 (n,), sorted unique.
            values: float32 (n, d); not modified.

        Raises:
            ValueError: bad keys or values, or d differs from what this table holds back.
        """
        _check_push(table, keys, values)
        held_keys, held = self._held_for(table, values.shape[1])
        pos, found = _find(held_keys, keys)
        merged = values.clone()
        merged[found] += held[pos[found]]
        # "not below" rather than ">=": a row holding NaN is sent, never held back forever
        send = ~(_row_max(merged) < self.threshold)
        _, pushed = _find(keys, held_keys)
        keep_keys = torch.cat([held_keys[~pushed], keys[~send]])
        keep_rows = torch.cat([held[~pushed], merged[~send]])
        order = torch.argsort(keep_keys)  # the two parts hold different keys
        self._held[table] = (keep_keys[order], keep_rows[order])
        return keys[send], merged[send]

    def flush(self, table: str) -> tuple[Tensor, Tensor]:
        """Everything still held back for table, (keys, values), and forget it."""
        keys, rows = self._held_for(table, None)
        self._held.pop(table, None)
        return keys, rows

    def _held_for(self, table: str, dim: int | None) -> tuple[Tensor, Tensor]:
        """The table's held (keys, rows); rows (0, dim) when none, checked against dim."""
        empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, dim or 0))
        keys, rows = self._held.get(table, empty)
        if dim is None or rows.shape[1] == dim:
            return keys, rows
        if rows.shape[0]:
            raise ValueError(f"table {table!r}: a push of rows of {dim} values, but "
                             f"{rows.shape[0]} held rows have {rows.shape[1]}")
        return keys, torch.empty(0, dim)


def _row_max(values: Tensor) -> Tensor:
    if values.shape[1] == 0:
        return torch.zeros(values.shape[0])
    return values.abs().amax(dim=1)


def _flat_bytes(t: Tensor) -> memoryview:
    """t's bytes without a copy (the view keeps t alive)."""
    return t.contiguous().numpy().data.cast("B")


def _int8_blocks(flat: Tensor, block: int) -> Tensor:
    """flat, zero-padded to whole blocks, as (blocks, block)."""
    n_blocks = -(-flat.numel() // block)
    padded = torch.zeros(n_blocks * block)
    padded[: flat.numel()] = flat
    return padded.view(n_blocks, block)


def _encode_int8(flat: Tensor, block: int) -> list[Frame]:
    blocks = _int8_blocks(flat, block)
    scales = blocks.abs().amax(dim=1) / 127 if blocks.numel() else torch.empty(0)
    if not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).nonzero()[0])
        raise ValueError(f"int8: block {bad} holds inf or nan; int8 needs finite values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)  # an all-zero block stays 0
    q = torch.round(blocks / divisor).clamp_(-127, 127).to(torch.int8)
    return [_flat_bytes(q.view(-1)[: flat.numel()]), _flat_bytes(scales)]


def _encode(flat: Tensor, codec: str, block: int) -> list[Frame]:
    if codec == "none":
        return [_flat_bytes(flat)]
    if codec == "fp16":
        return [_flat_bytes(flat.to(torch.float16))]
    if codec == "bf16":  # NumPy has no bfloat16: its bits travel as int16
        return [_flat_bytes(flat.to(torch.bfloat16).view(torch.int16))]
    return _encode_int8(flat, block)


def _check_codec(codec: object, block: object) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid codecs: {list(CODECS)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"codec {codec!r}: block must be an int >= 1, got {block!r}")


def encode(values: Tensor, codec: str, block: int = 256) -> tuple[list[Frame], dict[str, Any]]:
    """values as frames to send and a JSON-able meta that :func:`decode` needs.

    ``none`` is float32's bytes (a view of values when it is a contiguous CPU tensor: do not
    write values before the frames are sent); ``fp16`` and ``bf16`` round to nearest (fp16
    overflows to inf beyond 65504); ``int8`` sends round(x / scale) with, per run of
    ``block`` elements of the flattened values, scale = max |x| / 127 (float32), so each
    element is off by at most scale / 2.

    Raises:
        ValueError: values not float32, an unknown codec, block < 1, or int8 of inf/nan.
    """
    _check_codec(codec, block)
    if values.dtype != torch.float32:
        raise ValueError(f"encode: values must be float32, got {values.dtype}")
    flat = values.detach().cpu().reshape(-1)
    meta = {"codec": codec, "shape": list(values.shape), "block": block}
    return _encode(flat, codec, block), meta


def _frame_sizes(codec: str, numel: int, block: int) -> list[int]:
    if codec == "int8":
        return [numel, 4 * -(-numel // block)]
    return [numel * (4 if codec == "none" else 2)]


def _check_meta(meta: object) -> tuple[str, list[int], int]:
    if not isinstance(meta, dict):
        raise ValueError(f"decode: meta must be a dict, got {type(meta).__name__}")
    codec, shape, block = meta.get("codec"), meta.get("shape"), meta.get("block", 1)
    _check_codec(codec, block)
    if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"decode: shape must be a list of ints >= 0, got {shape!r}")
    return codec, shape, block  # type: ignore[return-value]


def _decode(views: list[memoryview], codec: str, numel: int, block: int) -> Tensor:
    if codec == "none":
        return torch.from_numpy(np.frombuffer(views[0], "<f4").copy())
    if codec == "fp16":
        return torch.from_numpy(np.frombuffer(views[0], "<f2").astype(np.float32))
    if codec == "bf16":  # a bfloat16 is the top half of the float32 it stands for
        bits = np.frombuffer(views[0], "<u2").astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32))
    q = torch.from_numpy(np.frombuffer(views[0], np.int8).astype(np.float32))
    blocks = _int8_blocks(q, block)
    scales = torch.from_numpy(np.frombuffer(views[1], "<f4").copy())
    return (blocks * scales.unsqueeze(1)).view(-1)[:numel]


def decode(frames: list[Frame], meta: dict[str, Any]) -> Tensor:
    """The float32 tensor of meta's shape that :func:`encode` made these frames from.

    Raises:
        ValueError: an unknown codec, a bad meta, or frames whose number or sizes differ
            from what the meta implies (naming the expected and received bytes).
    """
    codec, shape, block = _check_meta(meta)
    numel = math.prod(shape)
    expected = _frame_sizes(codec, numel, block)
    if len(frames) != len(expected):
        raise ValueError(f"decode {codec}: expected {len(expected)} frame(s) for shape {shape}, "
                         f"got {len(frames)}")
    views = [memoryview(f).cast("B") for f in frames]
    for i, (want, view) in enumerate(zip(expected, views, strict=True)):
        if view.nbytes != want:
            raise ValueError(f"decode {codec}: frame {i} for shape {shape} should be {want} "
                             f"bytes, got {view.nbytes}")
    return _decode(views, codec, numel, block).reshape(shape)


def encoded_bytes(frames: list[Frame]) -> int:
    """The bytes these frames put on the wire (payload only)."""
    return sum(memoryview(f).nbytes for f in frames)
