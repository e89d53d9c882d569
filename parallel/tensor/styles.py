"""Tensor-parallel styles: what one module of a plan becomes on the ``tp`` group.

A style is a small value; :meth:`Style.apply` turns the module (the same weights on every
rank) into this rank's part and returns it. HuggingFace's style names
(``config.base_model_tp_plan``) are accepted as strings (:func:`style_of`); a name this
project cannot honour is refused with the list of those it can.

Where a style changes the module (the linear and embedding styles) it accepts only the
exact classes whose forward it reproduces (``nn.Linear``, ``nn.Embedding``, and
HuggingFace's ``Conv1D`` with ``transposed=True``): a subclass with its own ``forward``
(a scaled embedding, a LoRA linear) would be replaced by a layer that does not compute
what it did, so it is refused, by path and class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import comms
from .parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class TPContext:
    """Where a style is applied: the group, the module's path, whether its input is this
    rank's part of the sequence (sequence parallelism inside the blocks), and whether
    the loss reads vocab-split logits."""

    group: Any
    world: int
    path: str
    sequence_parallel: bool
    parallel_loss: bool
    input_gathered: bool = False  # a split region's module gathered the sequence already
    experts_by_ep: bool = False  # fused experts are split by expert parallelism instead


class Style:
    """Base of the styles; ``changes_module``: the module is replaced or resized."""

    changes_module = True

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        raise NotImplementedError


def _linear_like(module: nn.Module, ctx: TPContext, transposed: bool, style: str) -> None:
    """Refuses a module whose forward is not ``x @ W.T + b`` (``x @ W + b`` transposed)."""
    if transposed:
        ok = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
        want = "HuggingFace's Conv1D (weight (in, out))"
    else:
        ok = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
        want = "nn.Linear"
    if not ok:
        raise TypeError(f"tensor parallel: {ctx.path} is a {type(module).__name__}; the "
                        f"style {style} replaces {want} (a subclass with its own forward "
                        "would not compute what it did): give it another style")


@dataclass(frozen=True)
class Colwise(Style):
    """Column parallel: this rank's output features (``interleave`` blocks of them, each
    split: 3 for a fused Q, K, V, 2 for a packed gate and up projection). The output is
    split along its last dimension, for a rowwise layer after it; ``gather_output``
    gathers it whole."""

    interleave: int = 1
    transposed: bool = False
    gather_output: bool = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        _linear_like(module, ctx, self.transposed, "colwise")
        return ColumnParallelLinear.from_dense(
            module, ctx.group, transposed=self.transposed, interleave=self.interleave,
            gather_output=self.gather_output, sequence_parallel=ctx.sequence_parallel,
            input_gathered=ctx.input_gathered)


@dataclass(frozen=True)
class Rowwise(Style):
    """Row parallel: this rank's input features; the partial outputs are summed
    (reduce-scattered along the sequence inside a sequence-parallel region).
    ``split_input``: the input arrives whole on every rank (after a gathered column-
    parallel layer whose output the model slices itself, as Phi-3's fused QKV and
    gate-up are) and each rank takes its features of it; backward gathers them."""

    transposed: bool = False
    split_input: bool = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        _linear_like(module, ctx, self.transposed, "rowwise")
        return RowParallelLinear.from_dense(module, ctx.group, transposed=self.transposed,
                                            sequence_parallel=ctx.sequence_parallel,
                                            input_is_parallel=not self.split_input)


def _embed_scale(module: nn.Module) -> torch.Tensor | None:
    """The scale of HuggingFace's ``*ScaledWordEmbedding`` (an ``nn.Embedding`` whose
    forward multiplies the lookup by the buffer ``embed_scale``: Gemma's), else None."""
    scale = getattr(module, "embed_scale", None)
    scaled = (type(module).__bases__ == (nn.Embedding,) and torch.is_tensor(scale)
              and type(module).__name__.endswith("ScaledWordEmbedding"))
    return scale if scaled else None


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """A vocab-parallel embedding whose lookup is multiplied by ``embed_scale``."""

    embed_scale: torch.Tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.embed_scale.to(self.weight.dtype)


@dataclass(frozen=True)
class VocabEmbedding(Style):
    """An ``nn.Embedding`` split by vocabulary rows (Megatron's VocabParallelEmbedding);
    HuggingFace's scaled word embeddings keep their scale."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        scale = _embed_scale(module)
        if type(module) is not nn.Embedding and scale is None:
            raise TypeError(f"tensor parallel: {ctx.path} is a {type(module).__name__}; the "
                            "style vocab_embedding replaces nn.Embedding only (a subclass "
                            "may scale or pad what it returns): give it another style")
        layer = VocabParallelEmbedding.from_dense(module, ctx.group)  # type: ignore[arg-type]
        if scale is None:
            return layer
        layer.__class__ = ScaledVocabParallelEmbedding
        layer.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        return layer


@dataclass(frozen=True)
class VocabHead(Style):
    """The LM head split by vocabulary: logits stay split for the vocab-parallel
    cross-entropy, or are gathered when the loss is the user's own."""

    transposed: bool = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        _linear_like(module, ctx, self.transposed, "vocab_head")
        return ColumnParallelLinear.from_dense(module, ctx.group, transposed=self.transposed,
                                               gather_output=not ctx.parallel_loss)


@dataclass(frozen=True)
class PartialGrad(Style):
    """Whole on every rank but applied to split activations (a norm of each rank's heads):
    each rank's gradient is partial and the gradient is their sum over ``tp``
    (HuggingFace's ``replicated_with_grad_allreduce``)."""

    changes_module = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        for p in module.parameters():
            p.tp_partial_grad = True  # type: ignore[attr-defined]
        return module


@dataclass(frozen=True)
class MlaKvAProj(Style):
    """Multi-head latent attention's joint KV down-projection (DeepSeek-V2's
    ``kv_a_proj_with_mqa``), whole on every rank. Its output is the compressed KV, which
    goes through a norm to the column-split ``kv_b_proj`` (whose backward sums the
    input's gradient over the ranks), and the last ``rope_dim`` features, one rotary key
    shared by every head, which go straight to attention: each rank's heads give only
    their part of that gradient, so it is summed over ``tp`` in backward (HF's
    ``mla_kv_a_proj``). The weight's gradient is then whole on every rank."""

    rope_dim: int
    changes_module = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        if ctx.sequence_parallel:
            raise ValueError(f"tensor parallel: {ctx.path} (mla_kv_a_proj) runs whole on "
                             "whole activations; sequence parallelism would give it this "
                             "rank's part of the sequence: use sequence_parallel=False")
        rope, group = self.rope_dim, ctx.group

        def sum_rope_grad(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            compressed, shared_key = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([compressed, comms.copy_to_tp_region(shared_key, group)], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module


@dataclass(frozen=True)
class Replicated(Style):
    """Whole on every rank, applied to whole activations: nothing to do (said, so that
    the plan covers it)."""

    changes_module = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        return module


@dataclass(frozen=True)
class LocalSizes(Style):
    """Integer attributes that count a split dimension (a head count, a split size),
    divided by the tensor-parallel size: the module's own code then reshapes this rank's
    part. The module itself stays."""

    attributes: tuple[str, ...]

    changes_module = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        for name in self.attributes:
            value = getattr(module, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"tensor parallel: {ctx.path}.{name} is {value!r}, not an int "
                                "that the style local_sizes can divide")
            if value % ctx.world:
                raise ValueError(f"tensor parallel: {ctx.path}.{name} = {value} is not "
                                 f"divisible by tp = {ctx.world}")
            setattr(module, name, value // ctx.world)
        return module


@dataclass(frozen=True)
class PerRankRandom(Style):
    """The module's random draws (attention dropout on this rank's heads) come from the
    per-rank tensor-parallel stream, as Megatron-LM's: every draw in it must be on split
    activations. The module itself stays."""

    changes_module = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        from ..rng import TENSOR_PARALLEL, TRACKER

        forward = module.forward

        def forked(*args: Any, **kwargs: Any) -> Any:
            with TRACKER.fork(TENSOR_PARALLEL):
                return forward(*args, **kwargs)

        module.forward = forked
        return module


@dataclass(frozen=True)
class TorchMultiheadAttention(Style):
    """``nn.MultiheadAttention`` (self-attention) with this rank's heads."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        from .multihead import ParallelMultiheadAttention

        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"tensor parallel: {ctx.path} is a {type(module).__name__}, not "
                            "nn.MultiheadAttention (style mha)")
        return ParallelMultiheadAttention.from_torch(module, ctx.group, ctx.path,
                                                     ctx.sequence_parallel)


_FUSED_EXPERTS = ("gate_up_proj", "down_proj", "num_experts")


@dataclass(frozen=True)
class TPExperts(Style):
    """Fused experts (HuggingFace's ``*Experts``: ``gate_up_proj`` ``(E, 2I, H)``,
    ``down_proj`` ``(E, H, I)``) with this rank's ``I / TP`` intermediate units of every
    expert (``moe_tp_experts``: the packed gate and up split as ``packed_colwise``, the
    down projection as ``rowwise``). The module's own forward runs on them; its input and
    the routing weights are copied into the region (their gradients summed over ``tp``)
    and its partial output summed, as Megatron-LM's MLP."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        from ..tensor import comms
        from ..tensor.sharding import TPSpec, mark

        if ctx.experts_by_ep:  # whole on every TP rank; expert parallelism splits them
            return module
        missing = [a for a in _FUSED_EXPERTS if not hasattr(module, a)]
        gate_up: Any = getattr(module, "gate_up_proj", None)
        if missing or gate_up.dim() != 3:
            raise TypeError(f"tensor parallel: {ctx.path} is a {type(module).__name__}, not "
                            f"fused experts (moe_tp_experts needs {_FUSED_EXPERTS}; lacks "
                            f"{missing})")
        if ctx.sequence_parallel:
            raise ValueError(f"tensor parallel: {ctx.path}: experts split by tp "
                             "(moe_tp_experts) with sequence parallelism is not supported")
        for name, spec in (("gate_up_proj", TPSpec(dim=1, interleave=2)),
                           ("down_proj", TPSpec(dim=2))):
            whole = getattr(module, name)
            if whole.shape[spec.dim or 0] % (ctx.world * spec.interleave):
                raise ValueError(f"tensor parallel: {ctx.path}.{name} of shape "
                                 f"{tuple(whole.shape)} cannot be split over tp = {ctx.world}")
            part = nn.Parameter(spec.shard(whole.detach(), ctx.world, _rank(ctx)),
                                requires_grad=whole.requires_grad)
            mark(part, spec)
            setattr(module, name, part)
        forward, group = module.forward, ctx.group

        def split(hidden: Any, index: Any, weights: Any) -> Any:
            out = forward(comms.copy_to_tp_region(hidden, group), index,
                          comms.copy_to_tp_region(weights, group))
            return comms.reduce_from_tp_region(out, group)

        module.forward = split
        return module


def _rank(ctx: TPContext) -> int:
    import torch.distributed as dist

    return dist.get_rank(ctx.group)


# HuggingFace's names (transformers' tensor_parallel.py) and this project's.
_NAMED: dict[str, Style] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "colwise_rep": Colwise(gather_output=True),
    "colwise_gather_output": Colwise(gather_output=True),
    "rowwise_rep": Rowwise(),
    "rowwise_split_input": Rowwise(split_input=True),
    "packed_colwise": Colwise(interleave=2),
    "vocab_embedding": VocabEmbedding(),
    "embedding": VocabEmbedding(),
    "vocab_head": VocabHead(),
    "replicated_with_grad_allreduce": PartialGrad(),
    "partial_grad": PartialGrad(),
    "replicated": Replicated(),
    "sequence_parallel": Replicated(),  # a norm: its region decides (see from_plan)
    "per_rank_random": PerRankRandom(),
    "mha": TorchMultiheadAttention(),
    "moe_tp_experts": TPExperts(),
}


def style_of(style: Style | str, where: str) -> Style:
    """The style a plan entry names.

    Raises:
        ValueError: an unknown name, with the names this project supports.
    """
    if isinstance(style, Style):
        return style
    if style in _NAMED:
        return _NAMED[style]
    raise ValueError(f"plan entry {where!r}: tensor-parallel style {style!r} is not one this "
                     f"project implements; supported: {sorted(_NAMED)} (or a Style object)")
