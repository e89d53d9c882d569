"""torch's ``nn.MultiheadAttention`` with this rank's heads (Megatron's attention split).

The fused input projection becomes a column-parallel linear over three interleaved
blocks (Q, K, V: whole heads of each on every rank), the output projection a
row-parallel one; the call signature and the results stay torch's, so a user's block
that calls ``self.attn(h, h, h, attn_mask=mask)`` is unchanged. Self-attention only.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..rng import TENSOR_PARALLEL, TRACKER
from . import comms
from .comms import Group
from .parallel_linear import ColumnParallelLinear, RowParallelLinear


def _refuse_unsupported(mha: nn.MultiheadAttention, path: str, sequence_parallel: bool) -> None:
    problems = []
    if not mha._qkv_same_embed_dim:
        problems.append("kdim/vdim differ from embed_dim")
    if mha.bias_k is not None:
        problems.append("add_bias_kv")
    if mha.add_zero_attn:
        problems.append("add_zero_attn")
    if sequence_parallel and not mha.batch_first:
        problems.append("batch_first=False with sequence parallelism (the sequence is dim 1)")
    if problems:
        raise ValueError(f"tensor parallel: {path} (nn.MultiheadAttention) uses "
                         f"{', '.join(problems)}, which its split does not support")


class ParallelMultiheadAttention(nn.Module):
    """This rank's ``num_heads / TP`` heads of an ``nn.MultiheadAttention``."""

    # where torch's names for the parameters went (checkpoints speak torch's)
    original_names: ClassVar[dict[str, str]] = {"in_proj.weight": "in_proj_weight",
                                                 "in_proj.bias": "in_proj_bias"}

    def __init__(self, embed_dim: int, num_heads: int, in_proj: ColumnParallelLinear,
                 out_proj: RowParallelLinear, *, group: Group, dropout: float,
                 batch_first: bool):
        super().__init__()
        world = dist.get_world_size(group)
        self.embed_dim, self.num_heads, self.group = embed_dim, num_heads, group
        self.local_heads, self.head_dim = num_heads // world, embed_dim // num_heads
        self.first_head = dist.get_rank(group) * self.local_heads
        self.in_proj, self.out_proj = in_proj, out_proj
        self.dropout, self.batch_first = dropout, batch_first

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, group: Group, path: str,
                   sequence_parallel: bool = False) -> ParallelMultiheadAttention:
        _refuse_unsupported(mha, path, sequence_parallel)
        world = dist.get_world_size(group)
        if mha.num_heads % world:
            raise ValueError(f"tensor parallel: {path} has {mha.num_heads} heads, not "
                             f"divisible by tp = {world}")
        dense = SimpleNamespace(weight=mha.in_proj_weight, bias=mha.in_proj_bias)
        in_proj = ColumnParallelLinear.from_dense(dense, group, interleave=3,  # type: ignore[arg-type]
                                                  sequence_parallel=sequence_parallel)
        out_proj = RowParallelLinear.from_dense(mha.out_proj, group,
                                                sequence_parallel=sequence_parallel)
        return cls(mha.embed_dim, mha.num_heads, in_proj, out_proj, group=group,
                   dropout=mha.dropout, batch_first=mha.batch_first)

    def _local_mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                    batch: int, dtype: torch.dtype) -> torch.Tensor | None:
        """One additive mask ``(batch | 1, local heads | 1, T, S)`` from torch's two (a
        ``True`` in either is a position not attended)."""
        mask = None
        if attn_mask is not None:
            self._check_mask(attn_mask)
            mask = _additive(attn_mask, dtype)
            if mask.dim() == 3:  # (batch * heads, T, S): this rank's heads of it
                mask = mask.view(batch, self.num_heads, *mask.shape[1:])
                mask = mask[:, self.first_head : self.first_head + self.local_heads]
        if key_padding_mask is not None:
            pad = _additive(key_padding_mask, dtype)[:, None, None, :]
            mask = pad if mask is None else mask + pad
        return mask

    def _check_mask(self, attn_mask: torch.Tensor) -> None:
        seq = self._seq
        if tuple(attn_mask.shape[-2:]) != (seq, seq):
            raise ValueError(
                f"ParallelMultiheadAttention: attn_mask is {tuple(attn_mask.shape)} for a "
                f"sequence of {seq}: under sequence parallelism a block holds 1/tp of the "
                "sequence, so a mask built from its input's length is too small; take the "
                "mask from the plan's context (built from the whole sequence)")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not (query is key and key is value):
            raise TypeError("ParallelMultiheadAttention: self-attention only (query, key and "
                            "value must be the same tensor)")
        x = query if self.batch_first else query.transpose(0, 1)
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        batch, time = q.shape[:2]
        self._seq = time  # the whole sequence (the projection gathered it)
        q, k, v = (t.view(batch, time, self.local_heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        mask = self._local_mask(attn_mask, key_padding_mask, batch, q.dtype)
        causal = is_causal and mask is None
        p = self.dropout if self.training else 0.0
        with TRACKER.fork(TENSOR_PARALLEL) if p else nullcontext():
            if need_weights:
                y, weights = self._explicit(q, k, v, mask, causal, p, average_attn_weights)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                   is_causal=causal)
                weights = None
        out = self.out_proj(y.transpose(1, 2).reshape(batch, time, -1))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool, p: float,
                  average: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with its weights (torch's ``need_weights=True``): averaged over all
        heads (a sum over the TP ranks), or every head's (gathered)."""
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        if causal:
            t, s = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool,
                                                   device=q.device).triu(1), float("-inf"))
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(scores.softmax(-1), p) if p else scores.softmax(-1)
        y = weights @ v
        if average:
            summed = comms.reduce_from_tp_region(weights.sum(1), self.group)
            return y, summed / self.num_heads
        return y, comms.gather_dim(weights, 1, self.group)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf"))
    return mask.to(dtype)

