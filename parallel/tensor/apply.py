"""Converting the reference GPT to tensor parallelism in place, and back to a full state.

:func:`apply_tensor_parallel` swaps each block's attention and MLP for their parallel
versions, the token embedding for a vocab-parallel one and the LM head for a
column-parallel one, each loaded with this rank's shard of the model's own weights. The
model's code (``GPT.forward``, ``Block.forward``) is unchanged. With sequence
parallelism the embedding's output is split along the sequence, so norms, dropout and
residuals run on ``1/TP`` of the tokens; the parameters those touch (norms, the
row-parallel biases) get partial gradients on each rank, summed by one all-reduce when
backward ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import comms
from .comms import Group
from .layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    residual_stream,
)
from .random import TrackedDropout
from .sharding import REPLICATED, mark_tensor_parallel_group, spec_of

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _check_gpt_like(model: nn.Module) -> None:
    missing = [name for name in ("embed", "blocks", "lm_head") if not hasattr(model, name)]
    if missing or not hasattr(getattr(model, "embed"), "wte"):  # noqa: B009
        raise TypeError(f"apply_tensor_parallel: expected the reference GPT (embed.wte, "
                        f"blocks[i].attn / .mlp, lm_head); {type(model).__name__} lacks "
                        f"{missing or ['embed.wte']}")
    experts = [i for i, b in enumerate(getattr(model, "blocks"))  # noqa: B009
               if not hasattr(getattr(b, "mlp", None), "c_fc")]
    if experts:
        raise TypeError(f"apply_tensor_parallel: the MLP of block {experts[0]} has no c_fc/"
                        "c_proj (a mixture of experts?); this path splits the dense GPT only. "
                        "parallelize() splits experts (moe_tp_experts, or ParallelMesh(ep=))")


def apply_tensor_parallel(model: nn.Module, group: Group, sequence_parallel: bool = False,
                          parallel_output: bool = True, recompute_gather: bool = True
                          ) -> nn.Module:
    """Shard ``model`` (the same weights on every rank) across ``group``, in place.

    Args:
        model: the reference GPT (``pycomm.parallel.models.GPT``) or one shaped like it.
        group: the tensor-parallel group.
        sequence_parallel: split activations between the parallel layers along the
            sequence (reduce-scatter / all-gather instead of all-reduce).
        parallel_output: keep the logits split over the vocabulary (use
            :func:`vocab_parallel_cross_entropy`); ``False`` all-gathers them.
        recompute_gather: with sequence parallelism, gather a column-parallel layer's
            input again in backward instead of keeping it.

    Returns:
        ``model``.

    Raises:
        ValueError: heads, hidden sizes or vocabulary not divisible by the group size.
    """
    _check_gpt_like(model)
    gpt: Any = model  # duck-typed: the reference GPT's attribute names
    for block in gpt.blocks:
        parallelize_block(block, group, sequence_parallel, recompute_gather)
    parallelize_embedding(gpt.embed, group, sequence_parallel)
    gpt.lm_head = parallelize_head(gpt.lm_head, group, sequence_parallel, parallel_output,
                                   recompute_gather)
    if sequence_parallel:
        sum_partial_grads_on_arrival(model, group)
    mark_tensor_parallel_group(model, group)
    return model


# -- the parts ------------------------------------------------------------------------------------


def parallelize_block(block: nn.Module, group: Group, sequence_parallel: bool = False,
                      recompute_gather: bool = True) -> None:
    """Swap a reference ``Block``'s attention and MLP for their parallel versions (this
    rank's heads and hidden units of the same weights), in place."""
    b: Any = block
    b.attn = ParallelSelfAttention.from_dense(b.attn, group, sequence_parallel,
                                              recompute_gather=recompute_gather)
    # After the row-parallel projection: whole activations (the same mask on every
    # rank), or with sequence parallelism this rank's tokens (its own mask).
    b.resid_dropout = TrackedDropout(float(b.resid_dropout.p), residual_stream(sequence_parallel))
    b.mlp = ParallelMLP.from_dense(b.mlp, group, sequence_parallel,
                                   recompute_gather=recompute_gather)


def parallelize_embedding(embed: nn.Module, group: Group, sequence_parallel: bool = False) -> None:
    """A vocab-parallel token embedding; with sequence parallelism the embedding's output
    is split along the sequence (what the blocks then work on)."""
    e: Any = embed
    e.wte = VocabParallelEmbedding.from_dense(e.wte, group)
    if sequence_parallel:
        e.register_forward_hook(lambda _m, _a, out: comms.scatter_to_sequence_region(out, group))


def parallelize_head(lm_head: nn.Linear, group: Group, sequence_parallel: bool = False,
                     parallel_output: bool = True, recompute_gather: bool = True
                     ) -> ColumnParallelLinear:
    """The LM head as a column-parallel linear: logits split over the vocabulary
    (``parallel_output``; use :func:`vocab_parallel_cross_entropy`) or gathered."""
    return ColumnParallelLinear.from_dense(
        lm_head, group, gather_output=not parallel_output, sequence_parallel=sequence_parallel,
        recompute_gather=recompute_gather)


def _sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters applied to a rank's part of the sequence: their gradients are partial."""
    out = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            out += [p for p in module.parameters(recurse=False) if p.requires_grad]
        out += [p for p in module.parameters(recurse=False) if getattr(p, "sequence_parallel",
                                                                        False)]
    return list(dict.fromkeys(out))


def sum_partial_grads_on_arrival(model: nn.Module, group: Group) -> None:
    """Each partial gradient is summed over the group as it arrives, before autograd
    accumulates it: whatever else handles the gradient afterwards (a data-parallel
    bucket, ZeRO packing it into a shard and dropping ``.grad``) sees the whole one, and
    several backwards accumulate whole gradients. (Summing ``.grad`` once at the end of
    backward is one collective instead of one per parameter, but ZeRO may have taken the
    gradient away by then; ``pycomm.parallel.compose.parallelize`` sums them at its fixed phase.)"""
    for p in _sequence_parallel_params(model):
        p.register_hook(lambda grad: comms.all_reduce(grad.clone(), group))


def gather_tensor_parallel_state_dict(model: nn.Module, grads: bool = False
                                      ) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` (same names and shapes), or with ``grads``
    the gradients of its parameters under those names; collective over the group
    :func:`apply_tensor_parallel` used. Also for a model then sharded by ZeRO stage 3
    (``shard_model``), whose layers hold no weights between uses (parameters only).

    Raises:
        ValueError: ``grads`` of a stage-3 model (they live in its optimizer's shards).
    """
    if "zero3" in model.__dict__:
        if grads:
            raise ValueError("gather_tensor_parallel_state_dict: a ZeRO stage-3 model keeps "
                             "its gradients reduce-scattered in the optimizer's shards; "
                             "gather parameters only")
        return _gather_stage3(model)
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, _PARALLEL):
            prefix = f"{name}." if name else ""
            for key, value in module.full_state(grads).items():
                out[prefix + key] = value
                done.add(prefix + key)
    for key, value in model.state_dict(keep_vars=True).items():
        if key in done:
            continue
        if not grads:
            out[key] = value.detach().clone()
        elif isinstance(value, nn.Parameter):
            out[key] = value.grad.clone() if value.grad is not None else torch.zeros_like(value)
    return out


def _gather_stage3(model: nn.Module) -> dict[str, torch.Tensor]:
    """Stage 3 first gathers each unit whole over data parallelism (this rank's TP part),
    then each split parameter is gathered over its layer's TP group and joined."""
    local = model.__dict__["zero3"].full_state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, _PARALLEL):
            continue
        for key in ("weight", "bias"):
            original = getattr(module, key, None)
            full_name = f"{name}.{key}" if name else key
            spec = spec_of(original) if original is not None else REPLICATED
            if spec.dim is None or full_name not in local:
                continue
            part = local[full_name].contiguous()
            parts = [torch.empty_like(part) for _ in range(dist.get_world_size(module.group))]
            dist.all_gather(parts, part, group=module.group)
            local[full_name] = spec.unshard(parts)
    return local
