"""A model converted to tensor parallelism in place, by its plan, and back to a full state.

:func:`apply_tensor_parallel` is the plan-driven conversion :func:`pycomm.parallel.parallelize`
runs on each pipeline stage (:mod:`pycomm.parallel.tensor.from_plan`), applied to the whole
model: the plan's styles, checked first (every module given one or right to leave whole),
each layer loaded with this rank's shard of the model's own weights; ties tied again. The
model's code is unchanged. With sequence parallelism the first block splits its input
along the sequence and the last gathers its output (:mod:`pycomm.parallel.tensor.sequence`),
so norms, dropout and residuals between run on ``1/TP`` of the tokens; the parameters those
touch get partial gradients on each rank, each summed over the group as it arrives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..plans.plan import Plan, matching, resolve_layers
from . import comms
from .comms import Group
from .from_plan import (
    apply_styles,
    check_coverage,
    check_divisible,
    mark_partial_grads,
    partial_grad_params,
    styles_by_path,
)
from .parallel_linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .sequence import split_blocks
from .sharding import REPLICATED, mark_tensor_parallel_group, spec_of
from .tied import retie, tie_groups

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def apply_tensor_parallel(model: nn.Module, group: Group, sequence_parallel: bool = False,
                          parallel_output: bool = True, recompute_gather: bool = True,
                          plan: Plan | None = None) -> nn.Module:
    """Shard ``model`` (the same weights on every rank) across ``group``, in place.

    Args:
        model: a model with a plan: its own (``model.parallel_plan()``, as
            :class:`pycomm.parallel.models.GPT` has) or ``plan``.
        group: the tensor-parallel group.
        sequence_parallel: split activations between the split regions of the blocks
            along the sequence (reduce-scatter / all-gather instead of all-reduce).
        parallel_output: keep the logits split over the vocabulary (use
            :func:`vocab_parallel_cross_entropy`); ``False`` all-gathers them.
        recompute_gather: with sequence parallelism, a split region's column-parallel
            layers keep this rank's part of their input and gather it again in backward.
        plan: the model's :class:`pycomm.parallel.plans.Plan` (for any other model:
            ``pycomm.parallel.compose.plan_for(model)`` derives one for HuggingFace's).

    Returns:
        ``model``.

    Raises:
        TypeError: a model without a plan, or with one that splits nothing.
        ValueError: a count of the plan's ``divisible`` (heads), a hidden size or the
            vocabulary not divisible by the group size; a module the plan leaves whole
            where whole is wrong.
    """
    plan = plan if plan is not None else _own_plan(model)
    paths = [p for layer in resolve_layers(plan, model) for p in layer.paths]
    blocks = matching(plan.blocks, model) if plan.blocks else []
    if sequence_parallel and not blocks:
        raise ValueError(f"sequence parallel: the plan for {plan.name} names no blocks "
                         "(Plan.blocks), the layers whose activations it would split")
    check_divisible(plan, dist.get_world_size(group))
    styles = styles_by_path(plan, model, paths)
    check_coverage(plan, model, paths, styles, blocks)
    ties = tie_groups(model)
    apply_styles(model, styles, group, blocks, sequence_parallel, parallel_output,
                 materialize=lambda _path, _module: None, recompute_gather=recompute_gather)
    retie(model, ties, {n for n, _ in model.named_parameters(remove_duplicate=False)})
    mark_partial_grads(model, paths, blocks, sequence_parallel)
    if sequence_parallel:
        split_blocks(model, blocks, group, dist.get_world_size(group))
    sum_partial_grads_on_arrival(model, group)
    mark_tensor_parallel_group(model, group)
    return model


def _own_plan(model: nn.Module) -> Plan:
    own = getattr(model, "parallel_plan", None)
    plan = own() if callable(own) else None
    if not isinstance(plan, Plan) or not plan.tp:
        raise TypeError(f"apply_tensor_parallel: {type(model).__name__} has no tensor-parallel "
                        "plan (model.parallel_plan() naming styles in Plan.tp); pass plan=, "
                        "e.g. pycomm.parallel.compose.plan_for(model) for a HuggingFace model")
    return plan


def sum_partial_grads_on_arrival(model: nn.Module, group: Group) -> None:
    """Each partial gradient is summed over the group as it arrives, before autograd
    accumulates it: whatever else handles the gradient afterwards (a data-parallel
    bucket, ZeRO packing it into a shard and dropping ``.grad``) sees the whole one, and
    several backwards accumulate whole gradients. (Summing ``.grad`` once at the end of
    backward is one collective instead of one per parameter, but ZeRO may have taken the
    gradient away by then; ``pycomm.parallel.compose.parallelize`` sums them at its fixed phase.)"""
    for p in partial_grad_params(list(dict.fromkeys(model.parameters()))):
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
