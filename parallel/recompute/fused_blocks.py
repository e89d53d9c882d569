"""Using the fused kernels in the reference GPT's blocks, without changing its code.

:func:`apply_fused_kernels` re-points each block's ``forward`` so its MLP half runs
``c_fc`` without its bias, then :func:`fused_bias_gelu` (bias and GeLU in one pass), and
``c_proj`` without its bias, then :func:`fused_bias_dropout_add` (bias, dropout and the
residual add in one pass, the mask kept as a seed). The attention half is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fused import fused_bias_dropout_add, fused_bias_gelu


def _fused_block_forward(block: Any) -> Any:
    mlp = block.mlp
    p = float(getattr(mlp.dropout, "p", 0.0))

    def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = block.ln_1(x)
        x = x + (block.attn(h) if mask is None else block.attn(h, mask=mask))
        h = fused_bias_gelu(F.linear(block.ln_2(x), mlp.c_fc.weight), mlp.c_fc.bias)
        return fused_bias_dropout_add(F.linear(h, mlp.c_proj.weight), mlp.c_proj.bias, x, p,
                                      block.training)

    return forward


def apply_fused_kernels(model: nn.Module) -> list[nn.Module]:
    """Fuse the MLP half of every block shaped like the reference GPT's (``ln_1``,
    ``attn``, ``ln_2``, ``mlp.c_fc``/``c_proj`` with biases); returns those blocks.

    Raises:
        ValueError: if no such block is found.
    """
    blocks = [m for m in model.modules()
              if all(hasattr(m, a) for a in ("ln_1", "attn", "ln_2", "mlp"))
              and all(isinstance(getattr(m.mlp, name, None), nn.Linear)
                      and getattr(m.mlp, name).bias is not None for name in ("c_fc", "c_proj"))]
    if not blocks:  # (tensor-parallel MLPs are not nn.Linear: their layers communicate)
        raise ValueError("apply_fused_kernels: no block with ln_1, attn, ln_2 and an MLP of "
                         "biased nn.Linear c_fc/c_proj found")
    for block in blocks:
        block.forward = _fused_block_forward(block)
    return blocks
