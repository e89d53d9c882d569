"""Fused recompute ops: ``fused_bias_gelu`` and ``fused_bias_dropout_add``.

Each is one pass over memory in C++ (``pycomm._C``: several threads for large CPU
tensors, one kernel on the caller's stream for CUDA tensors in a CUDA build) instead of
two or three PyTorch ops, and keeps for backward only its inputs: no GeLU
input and no dropout mask. The backward recomputes ``x + bias`` (and, from a seed, the
mask) inside the kernel that computes the gradient. The seed is drawn from torch's
generator, so a checkpointed recomputation, which restores that generator, draws the
same mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pycomm._extension import load as _extension


def _kernel(name: str, x: torch.Tensor, **others: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``pycomm._C``'s ``name`` for ``x``'s device (``name_cuda`` for CUDA tensors), once
    every other tensor is found on that device too."""
    for what, t in others.items():
        if t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device}, the input on {x.device}")
    ext = _extension()
    if not x.is_cuda:
        return getattr(ext, name)  # which refuses devices other than the CPU, naming them
    kernel = getattr(ext, f"{name}_cuda", None)
    if kernel is None:
        raise ValueError(f"{name}: the input is on {x.device}, but pycomm._C was built without "
                         "CUDA (rebuild with a CUDA torch and nvcc: pip install "
                         "--no-build-isolation -e .)")
    return kernel


def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class _FusedBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        kernel = _kernel("fused_bias_gelu", x, bias=bias)
        x, bias = x.contiguous(), bias.contiguous()
        ctx.save_for_backward(x, bias)
        return kernel(x, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, bias = ctx.saved_tensors
        kernel = _kernel("fused_bias_gelu_backward", x, gradient=grad)
        grad_x = kernel(grad.contiguous(), x, bias)
        return grad_x, _bias_grad(grad_x)


class _FusedBiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                p: float, seed: int) -> torch.Tensor:
        kernel = _kernel("fused_bias_dropout_add", x, bias=bias, residual=residual)
        ctx.p, ctx.seed = p, seed
        return kernel(x.contiguous(), bias.contiguous(), residual.contiguous(), p, seed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        kernel = _kernel("fused_dropout_backward", grad)
        grad_x = kernel(grad.contiguous(), ctx.p, ctx.seed)
        return grad_x, _bias_grad(grad_x), grad, None, None


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x + bias)`` (exact GeLU) in one pass: float32 or bfloat16 on CPU, and
    float16 too on CUDA (a CUDA build of ``pycomm._C``).

    Raises:
        ValueError: if ``bias`` is not 1-D of ``x``'s last size, dtype and device.
    """
    return _FusedBiasGelu.apply(x, bias)


def fused_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                           p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x + bias, p, training) + residual`` in one pass, the mask kept as a
    seed (drawn from torch's CPU generator, whatever the device: CPU and CUDA draw the
    same mask from a seed).

    Raises:
        ValueError: on a bias or residual unlike ``x`` (shape, dtype, device), or p
            outside [0, 1).
    """
    p = p if training else 0.0
    seed = int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0
    return _FusedBiasDropoutAdd.apply(x, bias, residual, p, seed)
