"""Tensor-parallel layers: the parallel linears and embedding, and the two halves of a
transformer block built from them (:class:`ParallelSelfAttention`, :class:`ParallelMLP`).

Both blocks are a column-parallel linear, local math on this rank's part (whole heads;
a quarter of the MLP's hidden units at TP = 4), and a row-parallel linear, so each
communicates once in forward and once in backward (twice each with sequence
parallelism: an all-gather before, a reduce-scatter after).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..rng import REPLICATED, TENSOR_PARALLEL, TRACKER
from .comms import Group
from .parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .random import TrackedDropout

__all__ = ["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def residual_stream(sequence_parallel: bool) -> str:
    """Dropout after a row-parallel layer: on whole (replicated) activations it must
    match across ranks; on a rank's part of the sequence it must not."""
    return TENSOR_PARALLEL if sequence_parallel else REPLICATED


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with this rank's ``n_head / TP`` heads.

    Raises:
        ValueError: if ``n_head`` (or ``n_embd``) is not divisible by the group's size.
    """

    def __init__(self, n_embd: int, n_head: int, *, group: Group, bias: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False):
        super().__init__()
        world = dist.get_world_size(group)
        if n_head % world:
            raise ValueError(f"ParallelSelfAttention: {n_head} heads are not divisible by the "
                             f"tensor-parallel size {world}")
        self.n_head = n_head // world  # local heads
        sp: dict[str, Any] = {"group": group, "sequence_parallel": sequence_parallel}
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, bias, interleave=3, **sp)
        self.c_proj = RowParallelLinear(n_embd, n_embd, bias, **sp)
        self.attn_dropout = dropout  # (the residual dropout after it is the block's)

    @classmethod
    def from_dense(cls, attn: Any, group: Group, sequence_parallel: bool = False,
                   **kwargs: Any) -> ParallelSelfAttention:
        """From the reference model's ``CausalSelfAttention`` (``c_attn``, ``c_proj``,
        ``n_head``): this rank's heads of the same weights."""
        c_attn, c_proj = attn.c_attn, attn.c_proj
        dropout = float(attn.attn_dropout)
        layer = cls(c_attn.in_features, int(attn.n_head), group=group,
                    bias=c_attn.bias is not None, dropout=dropout,
                    sequence_parallel=sequence_parallel)
        sp: dict[str, Any] = {"sequence_parallel": sequence_parallel, **kwargs}
        layer.c_attn = ColumnParallelLinear.from_dense(c_attn, group, interleave=3, **sp)
        layer.c_proj = RowParallelLinear.from_dense(c_proj, group,
                                                    sequence_parallel=sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: what each query may attend to, as the GPT's attention takes it
        (:func:`pycomm.parallel.models.masks.attention_mask_of`); None: causal."""
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # (batch, time, local heads * head dim)
        batch, time, _ = q.shape
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.attn_dropout if self.training else 0.0
        causal = mask is None
        if dropout:  # each rank drops in its own heads
            with TRACKER.fork(TENSOR_PARALLEL):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                   is_causal=causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        y = y.transpose(1, 2).reshape(batch, time, -1)
        return self.c_proj(y)


class ParallelMLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` with this rank's ``hidden / TP`` hidden units."""

    def __init__(self, n_embd: int, hidden: int, *, group: Group, bias: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False):
        super().__init__()
        sp: dict[str, Any] = {"group": group, "sequence_parallel": sequence_parallel}
        self.c_fc = ColumnParallelLinear(n_embd, hidden, bias, **sp)
        self.c_proj = RowParallelLinear(hidden, n_embd, bias, **sp)
        self.dropout = TrackedDropout(dropout, residual_stream(sequence_parallel))

    @classmethod
    def from_dense(cls, mlp: Any, group: Group, sequence_parallel: bool = False,
                   **kwargs: Any) -> ParallelMLP:
        """From the reference model's ``MLP`` (``c_fc``, ``c_proj``, ``dropout``)."""
        c_fc, c_proj = mlp.c_fc, mlp.c_proj
        layer = cls(c_fc.in_features, c_fc.out_features, group=group,
                    bias=c_fc.bias is not None, dropout=float(getattr(mlp.dropout, "p", 0.0)),
                    sequence_parallel=sequence_parallel)
        layer.c_fc = ColumnParallelLinear.from_dense(
            c_fc, group, sequence_parallel=sequence_parallel, **kwargs)
        layer.c_proj = RowParallelLinear.from_dense(c_proj, group,
                                                    sequence_parallel=sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))
