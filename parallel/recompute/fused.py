"""Fused recompute ops: ``fused_bias_gelu`` and ``fused_bias_dropout_add``.

Each is one pass over memory in C++ (``pycomm._C``, several threads for large tensors)
instead of two or three PyTorch ops, and keeps for backward only its inputs: no GeLU
input and no dropout mask. The backward recomputes ``x + bias`` (and, from a seed, the
mask) inside the kernel that computes the gradient. The seed is drawn from torch's
generator, so a checkpointed recomputation, which restores that generator, draws the
same mask.
"""

from __future__ import annotations

from typing import Any

import torch

from pycomm._backend import _extension


def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class _FusedBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x, bias = x.contiguous(), bias.contiguous()
        ctx.save_for_backward(x, bias)
        return _extension().fused_bias_gelu(x, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, bias = ctx.saved_tensors
        grad_x = _extension().fused_bias_gelu_backward(grad.contiguous(), x, bias)
        return grad_x, _bias_grad(grad_x)


class _FusedBiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                p: float, seed: int) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        return _extension().fused_bias_dropout_add(x.contiguous(), bias.contiguous(),
                                                   residual.contiguous(), p, seed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_x = _extension().fused_dropout_backward(grad.contiguous(), ctx.p, ctx.seed)
        return grad_x, _bias_grad(grad_x), grad, None, None


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x + bias)`` (exact GeLU) in one pass; float32 or bfloat16, CPU."""
    return _FusedBiasGelu.apply(x, bias)


def fused_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                           p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x + bias, p, training) + residual`` in one pass, the mask kept as a
    seed (drawn from torch's generator)."""
    p = p if training else 0.0
    seed = int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0
    return _FusedBiasDropoutAdd.apply(x, bias, residual, p, seed)
