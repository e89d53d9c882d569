"""Messages between parameter-server processes: a JSON header frame, then raw tensor
frames (ZeroMQ multipart; no pickling, so a peer can send nothing but data).

The header lists each tensor's dtype and shape; :func:`unpack` checks every frame's
length against them before a byte is interpreted, since a peer is not trusted.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_ELEMENTS = 1 << 31  # no one tensor of a message is larger (2 G elements)


class WireError(ValueError):
    """A message that does not parse: the peer is named by the caller."""


def pack(header: dict[str, Any], tensors: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()
         ) -> list[bytes | memoryview]:
    """The frames of one message: the header (with the tensors' dtypes and shapes added)
    and each tensor's bytes."""
    specs = []
    frames: list[bytes | memoryview] = []
    for t in tensors:
        if t.dtype not in _NAMES:
            raise WireError(f"cannot send dtype {t.dtype}; allowed: {sorted(DTYPES)}")
        t = t.detach().contiguous()
        specs.append([_NAMES[t.dtype], list(t.shape)])
        frames.append(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return [json.dumps({**header, "tensors": specs}).encode(), *frames]


def unpack(frames: list[bytes]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and the tensors of a message, every frame checked against the header."""
    if not frames:
        raise WireError("empty message")
    try:
        header = json.loads(frames[0])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise WireError(f"header is not an object with an 'op': {str(header)[:200]}")
    specs = header.get("tensors", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        listed = len(specs) if isinstance(specs, list) else "?"
        raise WireError(f"op {header['op']!r}: header lists {listed} tensors, message has "
                        f"{len(frames) - 1} data frames")
    return header, [_tensor(header["op"], i, spec, frame)
                    for i, (spec, frame) in enumerate(zip(specs, frames[1:], strict=True))]


def _tensor(op: str, i: int, spec: Any, frame: bytes) -> torch.Tensor:
    if (not isinstance(spec, list) or len(spec) != 2 or spec[0] not in DTYPES
            or not isinstance(spec[1], list)
            or not all(isinstance(d, int) and d >= 0 for d in spec[1])):
        raise WireError(f"op {op!r}: tensor {i}: bad spec {str(spec)[:100]}")
    dtype, shape = DTYPES[spec[0]], spec[1]
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise WireError(f"op {op!r}: tensor {i}: {n} elements exceeds {MAX_ELEMENTS}")
    want = n * torch.empty((), dtype=dtype).element_size()
    if len(frame) != want:
        raise WireError(f"op {op!r}: tensor {i} ({spec[0]} {shape}): frame holds "
                        f"{len(frame)} bytes, the header says {want}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape)
