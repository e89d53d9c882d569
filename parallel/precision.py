"""The dtype sums and losses are computed in: fp32 for half-precision tensors (a sum of
bf16 parts rounds at every addition), the tensor's own dtype when it is wider (a float64
model keeps float64; narrowing it would put fp32 rounding in every layout's result).
Gradient norms are summed in float64 (:func:`sum_of_squares`)."""

from __future__ import annotations

import torch


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of ``dtypes`` and float32."""
    widest = torch.float32
    for dtype in dtypes:
        widest = torch.promote_types(widest, dtype)
    return widest


# elements cast to float64 at a time by sum_of_squares: 8 MiB, however large the tensor
SQUARES_CHUNK = 1 << 20


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s squared elements, in float64 (a 0-dim tensor), cast a
    chunk at a time: a float64 copy of a whole gradient would hold twice its fp32 bytes
    beside it (four times bf16's) at the moment the norm is taken, the peak of a step."""
    total = torch.zeros((), dtype=torch.float64)
    for piece in tensor.detach().reshape(-1).split(SQUARES_CHUNK):
        wide = piece.double()
        total += torch.dot(wide, wide)
    return total


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in :func:`accumulation_dtype` (itself when already that wide)."""
    return tensor.to(accumulation_dtype(tensor.dtype))
