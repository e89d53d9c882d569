"""The dtype sums and losses are computed in: fp32 for half-precision tensors (a sum of
bf16 parts rounds at every addition), the tensor's own dtype when it is wider (a float64
model keeps float64; narrowing it would put fp32 rounding in every layout's result)."""

from __future__ import annotations

import torch


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of ``dtypes`` and float32."""
    widest = torch.float32
    for dtype in dtypes:
        widest = torch.promote_types(widest, dtype)
    return widest


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in :func:`accumulation_dtype` (itself when already that wide)."""
    return tensor.to(accumulation_dtype(tensor.dtype))
