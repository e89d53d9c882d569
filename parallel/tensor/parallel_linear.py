"""Megatron-LM's parallel linear and embedding layers, and the vocab-parallel loss.

A column-parallel linear keeps ``out/TP`` rows of the weight (its output is split along
the hidden dimension); a row-parallel linear keeps ``in/TP`` columns (its input is split
and its outputs are partial sums, reduced after it). An MLP or an attention block is a
column-parallel layer followed by a row-parallel one, so it communicates twice per
direction: once in ``f`` before it, once in ``g`` after it.

Each layer is built from its dense counterpart with ``from_dense`` (this rank's shard of
the same weights) and gives its whole weights back with ``full_state`` (collective).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comms
from .comms import SEQ_DIM, Group, sequence_part
from .sharding import TPSpec, mark


def _tp(group: Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(what: str, size: int, parts: int, world: int) -> None:
    if size % (parts * world):
        raise ValueError(f"{what}: {size} is not divisible by the tensor-parallel size {world}"
                         + (f" times {parts}" if parts > 1 else ""))


def _shaped_like(cls: Any, linear: Any, group: Group, transposed: bool, **kwargs: Any
                 ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """A parallel layer of ``cls`` for the dense ``linear`` (its sizes, dtype, device;
    weights not yet copied), its weight as ``(out, in)``, and its bias."""
    weight, bias = linear.weight, getattr(linear, "bias", None)
    dense = weight.t() if transposed else weight
    layer = cls(dense.shape[1], dense.shape[0], bias is not None, group=group,
                transposed=transposed, dtype=weight.dtype, device=weight.device, **kwargs)
    return layer, dense, bias


def _value(p: nn.Parameter, grads: bool) -> torch.Tensor:
    """``p``'s values, or its gradient (zeros if it has none)."""
    if not grads:
        return p.detach()
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _weight_and_bias_grads(grad: torch.Tensor, x: torch.Tensor, has_bias: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of ``W`` and ``b`` in ``x @ W.T + b`` given the output's."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_weight = grad_2d.t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_weight, grad_2d.sum(0) if has_bias else None


class _LinearGatherSequence(torch.autograd.Function):
    """``all_gather_sequence(x) @ W.T + b`` keeping only ``x`` (the rank's part of the
    sequence) for backward. Backward gathers ``x`` again while it computes the input
    gradient, then reduce-scatters that while it computes the weight gradient: the
    recomputation and both collectives hide behind the two matmuls (Megatron-core)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Group) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comms.gather_dim(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        gather, gathered = comms.gather_dim(x, SEQ_DIM, ctx.group, async_op=True)
        grad_total = grad.matmul(weight)  # overlaps the gather
        gather.wait()
        total = gathered()
        scatter, scattered = comms.reduce_scatter_dim(grad_total, SEQ_DIM, ctx.group,
                                                      async_op=True)
        grad_weight, grad_bias = _weight_and_bias_grads(grad, total, ctx.has_bias)  # overlaps
        scatter.wait()
        return scattered(), grad_weight, grad_bias, None


class _LinearOnGatheredSequence(torch.autograd.Function):
    """``x @ W.T + b`` on ``x``, a sequence a split region gathered before this layer,
    keeping only ``part`` (this rank's part of it) for backward: the weight's gradient
    gathers it again, behind the input gradient's matmul. The input gradient goes back
    through the region's gather (its reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, part: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, group: Group) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(part, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        part, weight = ctx.saved_tensors
        gather, gathered = comms.gather_dim(part, SEQ_DIM, ctx.group, async_op=True)
        grad_input = grad.matmul(weight)  # overlaps the gather
        gather.wait()
        grad_weight, grad_bias = _weight_and_bias_grads(grad, gathered(), ctx.has_bias)
        return grad_input, None, grad_weight, grad_bias, None


class _LinearAllReduceGradInput(torch.autograd.Function):
    """``x @ W.T + b`` after ``f``: forward the identity, backward the all-reduce of the
    input gradient, started asynchronously and overlapped with the weight-gradient
    matmul (Megatron-LM's async tensor-parallel all-reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Group) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight)
        reduce = comms.all_reduce_async(grad_input, ctx.group)
        grad_weight, grad_bias = _weight_and_bias_grads(grad, x, ctx.has_bias)  # overlaps it
        reduce.wait()
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with this rank holding ``out_features / TP`` rows of ``W``.

    Args:
        in_features, out_features: the dense layer's sizes.
        bias: whether there is a bias (split like the rows).
        gather_output: all-gather the output's last dimension (otherwise each rank keeps
            its split output, as the next row-parallel layer wants).
        group: the tensor-parallel group.
        sequence_parallel: the input is this rank's part of the sequence; it is gathered
            here (and, with ``recompute_gather``, gathered again in backward instead of
            being kept).
        interleave: the output is ``interleave`` equal blocks, each split across ranks
            (3 for an attention's fused Q, K, V, so each rank gets whole heads of each).
        recompute_gather: see ``sequence_parallel``.
        input_gathered: the input was gathered along the sequence before this layer (by
            the module holding it): its backward (a reduce-scatter) sums the input
            gradient, so this layer does not all-reduce it.

    Raises:
        ValueError: if ``out_features`` is not divisible by ``TP * interleave``, or
            ``gather_output`` is combined with ``interleave``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, *, group: Group, sequence_parallel: bool = False,
                 interleave: int = 1, recompute_gather: bool = True, transposed: bool = False,
                 input_gathered: bool = False, dtype: torch.dtype | None = None,
                 device: Any = None):
        super().__init__()
        world, _ = _tp(group)
        _check_divisible("ColumnParallelLinear out_features", out_features, interleave, world)
        if gather_output and interleave > 1:
            raise ValueError("ColumnParallelLinear: gather_output would interleave the blocks")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.sequence_parallel, self.interleave = sequence_parallel, interleave
        self.recompute_gather, self.transposed = recompute_gather, transposed
        self.input_gathered = input_gathered
        rows = out_features // world
        shape = (in_features, rows) if transposed else (rows, in_features)
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.bias = nn.Parameter(torch.zeros(rows, **factory)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's, per shard
        # The split is along the output features: rows of a Linear's weight, columns of
        # a transposed one (HuggingFace's Conv1D keeps (in, out)).
        mark(self.weight, TPSpec(1 if transposed else 0, interleave))
        mark(self.bias, TPSpec(0, interleave))

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a dense weight (out, in) or bias."""
        world, rank = _tp(self.group)
        blocks = full.reshape(self.interleave, world, -1, *full.shape[1:])
        return blocks[:, rank].reshape(-1, *full.shape[1:])

    def _unshard(self, shard: torch.Tensor) -> torch.Tensor:
        world, _ = _tp(self.group)
        parts = comms.gather_dim(shard.detach().unsqueeze(0), 0, self.group)  # (world, rows, ...)
        blocks = parts.reshape(world, self.interleave, -1, *shard.shape[1:]).transpose(0, 1)
        return blocks.reshape(-1, *shard.shape[1:])

    @property
    def weight_out_in(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it: (out / TP, in)."""
        return self.weight.t() if self.transposed else self.weight

    @classmethod
    def from_dense(cls, linear: nn.Module, group: Group, transposed: bool = False,
                   **kwargs: Any) -> ColumnParallelLinear:
        """From an ``nn.Linear`` (weight ``(out, in)``) or, ``transposed``, a layer whose
        weight is ``(in, out)`` (HuggingFace's ``Conv1D``): this rank's output features
        of the same weights, in the same dtype and on the same device."""
        layer, dense, bias = _shaped_like(cls, linear, group, transposed, **kwargs)
        if dense.device.type != "meta":
            with torch.no_grad():
                layer.weight_out_in.copy_(layer._shard(dense))
                if layer.bias is not None and bias is not None:
                    layer.bias.copy_(layer._shard(bias))
        return layer

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The dense layer's ``weight`` (and ``bias``), or their gradients; collective."""
        weight = _value(self.weight, grads)
        whole = self._unshard(weight.t() if self.transposed else weight)
        out = {"weight": whole.t().contiguous() if self.transposed else whole}
        if self.bias is not None:
            out["bias"] = self._unshard(_value(self.bias, grads))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_out_in
        if self.input_gathered:
            part = sequence_part(x) if self.recompute_gather else None
            y = (F.linear(x, weight, self.bias) if part is None else
                 _LinearOnGatheredSequence.apply(x, part, weight, self.bias, self.group))
        elif self.sequence_parallel and self.recompute_gather:
            y = _LinearGatherSequence.apply(x, weight, self.bias, self.group)
        elif self.sequence_parallel:
            y = F.linear(comms.gather_from_sequence_region(x, self.group), weight, self.bias)
        else:  # copy_to_tp_region's all-reduce, fused into the layer to overlap it
            y = _LinearAllReduceGradInput.apply(x, weight, self.bias, self.group)
        return comms.gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        world, _ = _tp(self.group)
        return (f"in={self.in_features}, out={self.out_features} (/{world}), "
                f"sequence_parallel={self.sequence_parallel}, interleave={self.interleave}")


class RowParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with this rank holding ``in_features / TP`` columns of ``W``;
    the partial outputs are summed (all-reduce, or reduce-scatter along the sequence
    with ``sequence_parallel``) and the bias, kept whole, is added once after.

    Raises:
        ValueError: if ``in_features`` is not divisible by TP.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, *, group: Group,
                 sequence_parallel: bool = False, transposed: bool = False,
                 dtype: torch.dtype | None = None, device: Any = None):
        super().__init__()
        world, _ = _tp(group)
        _check_divisible("RowParallelLinear in_features", in_features, 1, world)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.sequence_parallel, self.transposed = sequence_parallel, transposed
        cols = in_features // world
        factory = {"dtype": dtype, "device": device}
        shape = (cols, out_features) if transposed else (out_features, cols)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        mark(self.weight, TPSpec(0 if transposed else -1))
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]  # grads partial

    @property
    def weight_out_in(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it: (out, in / TP)."""
        return self.weight.t() if self.transposed else self.weight

    @classmethod
    def from_dense(cls, linear: nn.Module, group: Group, transposed: bool = False,
                   **kwargs: Any) -> RowParallelLinear:
        """From an ``nn.Linear`` or (``transposed``) a ``Conv1D``: this rank's input
        features of the same weights, in the same dtype and on the same device."""
        layer, dense, bias = _shaped_like(cls, linear, group, transposed, **kwargs)
        if dense.device.type != "meta":
            with torch.no_grad():
                layer.weight_out_in.copy_(comms.split_last(dense, group))
                if layer.bias is not None and bias is not None:
                    layer.bias.copy_(bias)
        return layer

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        weight = _value(self.weight, grads)
        whole = comms.gather_last(weight.t() if self.transposed else weight, self.group)
        out = {"weight": whole.t().contiguous() if self.transposed else whole}
        if self.bias is not None:
            out["bias"] = _value(self.bias, grads).clone()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comms.scatter_to_tp_region(x, self.group)
        y = F.linear(x, self.weight_out_in)
        if self.sequence_parallel:
            y = comms.reduce_scatter_to_sequence_region(y, self.group)
        else:
            y = comms.reduce_from_tp_region(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        world, _ = _tp(self.group)
        return (f"in={self.in_features} (/{world}), out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split across ranks: each rank looks
    up the tokens in its range, zeros for the rest, and an all-reduce sums them.

    Raises:
        ValueError: if ``num_embeddings`` is not divisible by TP.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group,
                 padding_idx: int | None = None, dtype: torch.dtype | None = None,
                 device: Any = None):
        super().__init__()
        world, rank = _tp(group)
        _check_divisible("VocabParallelEmbedding num_embeddings", num_embeddings, 1, world)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.per_rank = num_embeddings // world
        self.start = rank * self.per_rank
        self.padding_idx = padding_idx
        # The padding row's gradient stays zero (as nn.Embedding's) on the rank holding it.
        inside = padding_idx is not None and 0 <= padding_idx - self.start < self.per_rank
        self._local_padding = padding_idx - self.start if inside else None  # type: ignore[operator]
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype,
                                               device=device))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)
        mark(self.weight, TPSpec(0))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: Group) -> VocabParallelEmbedding:
        for option in ("max_norm", "sparse", "scale_grad_by_freq"):
            if getattr(embedding, option, None):
                raise ValueError(f"VocabParallelEmbedding: the embedding sets {option}, "
                                 "which a vocabulary split does not reproduce")
        weight = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    padding_idx=embedding.padding_idx, dtype=weight.dtype, device=weight.device)
        if weight.device.type != "meta":
            with torch.no_grad():
                layer.weight.copy_(weight[layer.start : layer.start + layer.per_rank])
        return layer

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        return {"weight": comms.gather_dim(_value(self.weight, grads), 0, self.group)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.start + self.per_rank)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self._local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return comms.reduce_from_tp_region(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group,
                ignore_index: int) -> torch.Tensor:
        _, rank = _tp(group)
        per_rank = logits.shape[-1]
        start = rank * per_rank
        ignored = target == ignore_index
        # 1: the global max, for a stable exp.
        top = comms.all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        # 2: the target's logit, from the one rank whose range holds it (none for an
        # ignored token).
        outside = (target < start) | (target >= start + per_rank) | ignored
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = comms.all_reduce(picked, group)
        # 3: the softmax denominator.
        exp = shifted.exp()
        total = comms.all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), outside, local, ignored)
        return (total.log() - picked).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        softmax, outside, local, ignored = ctx.saved_tensors
        hit = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -hit)
        return grad_logits * grad.masked_fill(ignored, 0.0).unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Group, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split ``logits`` (``(..., vocab / TP)``, this
    rank's range) against ``target`` (``(...)``, global token ids), with three
    all-reduces of per-token scalars and no full-vocabulary gather. A token whose target
    is ``ignore_index`` has loss 0 and no gradient: the sum over the others divided by
    their count equals ``F.cross_entropy(..., ignore_index=ignore_index)`` on the
    gathered logits.

    Raises:
        ValueError: a target outside ``[0, vocab)`` that is not ``ignore_index`` (the
            same on every TP rank, which all hold the targets).
    """
    vocab = logits.shape[-1] * dist.get_world_size(group)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"vocab-parallel cross-entropy: target {int(target[where])} at "
                         f"{where} is outside the vocabulary [0, {vocab}) and is not the "
                         f"ignore_index {ignore_index}")
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
