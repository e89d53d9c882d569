"""Building this rank's pipeline stage from a plan: which layers it keeps, their tensor-
parallel form, their weights (materialized from the meta device where needed), the
ties among them, and the :class:`PlannedLayer` modules the pipeline runs.

Every step reads the plan and the mesh only; nothing asks what class the model is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..mesh import ParallelMesh
from ..plans.plan import Plan, ResolvedLayer, matching, resolve_layers, under_any
from ..tensor.from_plan import (
    apply_styles,
    check_coverage,
    check_divisible,
    mark_partial_grads,
    styles_by_path,
)
from ..tensor.sequence import SequenceSplit, block_splits
from ..tensor.tied import canonical_names, retie, tie_groups
from .layers import ContextCache, PlannedLayer, planned_layers, stage_balance
from .materialize import Materializer


@dataclass
class Stage:
    """This rank's stage as built (see :func:`build_stage`)."""

    layers: list[ResolvedLayer]  # every layer of the plan
    balance: list[int]  # layers per stage
    mine: list[ResolvedLayer]  # this stage's
    held: list[str]  # their module paths
    blocks: list[str]  # every block's module paths (the sequence-parallel region)
    ties: list[list[str]]  # every tie group's names
    canonical: dict[str, str]  # alias -> canonical name
    stage_of: dict[str, int]  # every parameter name -> the stage holding it
    materializer: Materializer
    split_logits: bool = False
    modules: list[PlannedLayer] = field(default_factory=list)
    context: ContextCache | None = None  # the plan's context, shared by the modules


def plan_stage(model: nn.Module, plan: Plan, mesh: ParallelMesh, seed: int) -> Stage:
    """Which layers this rank keeps.

    Raises:
        ValueError: a pipeline over a plan with one layer, or fewer blocks than stages.
    """
    layers = resolve_layers(plan, model)
    pp = mesh.size("pp")
    if pp > 1 and len(layers) == 1:
        raise ValueError(f"pipeline: the plan for {plan.name} gives its forward as one layer "
                         "(no Plan.layers), so pp > 1 has nowhere to cut; give the layers "
                         "(plan=Plan(layers=[...], blocks=...))")
    balance = stage_balance(layers, pp, plan.name)
    first = sum(balance[: mesh.rank("pp")])
    mine = layers[first : first + balance[mesh.rank("pp")]]
    groups = tie_groups(model)
    canonical = canonical_names(groups)
    stage_of = {}
    for s, (start, count) in enumerate(zip(_starts(balance), balance, strict=True)):
        paths = [p for layer in layers[start : start + count] for p in layer.paths]
        for name, _ in model.named_parameters(remove_duplicate=False):
            if under_any(name.rpartition(".")[0], paths) and name not in stage_of:
                stage_of[name] = s
    held = [p for x in mine for p in x.paths]
    experts = matching(plan.experts, model) if plan.experts is not None else []
    return Stage(layers, balance, mine, held,
                 [p for x in layers if x.is_block for p in x.paths], groups, canonical,
                 stage_of, Materializer(model, plan.init, seed, canonical, experts=experts,
                                        held=held))


def _starts(balance: list[int]) -> list[int]:
    return [sum(balance[:s]) for s in range(len(balance))]


def drop_other_stages(model: nn.Module, stage: Stage) -> None:
    """Other stages' layers go to the meta device (their memory is freed; a parameter
    this stage shares with them stays here)."""
    mine = {layer.index for layer in stage.mine}
    for layer in stage.layers:
        if layer.index in mine:
            continue
        for path in layer.paths:
            if not under_any(path, stage.held):
                model.get_submodule(path).to("meta")


def tensor_parallel(model: nn.Module, plan: Plan, stage: Stage, mesh: ParallelMesh,
                    sequence_parallel: bool, parallel_loss: bool) -> None:
    """The plan's styles on this stage's modules (checked first: see
    :mod:`pycomm.parallel.tensor.from_plan`)."""
    group = mesh.group("tp")
    check_divisible(plan, mesh.size("tp"))
    styles = styles_by_path(plan, model, stage.held)
    check_coverage(plan, model, stage.held, styles, stage.blocks)
    # Both ends of a tie get their (shared) weights before either is split; the others
    # one module at a time, just before their style splits them.
    for names in stage.ties:
        for name in names:
            owner = name.rpartition(".")[0]
            if under_any(owner, stage.held):
                stage.materializer.module(owner, model.get_submodule(owner))
    stage.split_logits = apply_styles(model, styles, group, stage.blocks, sequence_parallel,
                                      parallel_loss, stage.materializer,
                                      experts_by_ep=mesh.size("ep") > 1)
    mark_partial_grads(model, stage.held, stage.blocks, sequence_parallel)


def materialize_rest(model: nn.Module, stage: Stage, but_zero3: bool) -> None:
    """Weights for what is still on the meta device: the stage's modules (unless ZeRO-3
    materializes them unit by unit) and the modules outside every layer (a rotary
    table that every stage's context uses)."""
    layer_paths = [p for layer in stage.layers for p in layer.paths]
    for path, module in model.named_modules(remove_duplicate=False):
        outside = not under_any(path, layer_paths)
        if outside or (not but_zero3 and under_any(path, stage.held)):
            stage.materializer.module(path, module)


def tie_here(model: nn.Module, stage: Stage) -> None:
    """Names this stage holds that are one parameter are one again (after the styles)."""
    held = {n for n, s in stage.stage_of.items() if under_any(n.rpartition(".")[0], stage.held)}
    retie(model, stage.ties, held)


def cast(model: nn.Module, stage: Stage, dtype: torch.dtype) -> None:
    """The stage's floating parameters and buffers in ``dtype`` (the masters' dtype)."""
    for path in stage.held:
        module = model.get_submodule(path)
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def sequence_splits(stage: Stage, mesh: ParallelMesh, sequence_parallel: bool
                    ) -> dict[int, SequenceSplit]:
    """Each block's :class:`SequenceSplit`: the first splits, the last gathers.

    Raises:
        ValueError: the plan names no blocks (the region sequence parallelism splits).
    """
    if not sequence_parallel:
        return {}
    blocks = [x.index for x in stage.layers if x.is_block]
    if not blocks:
        raise ValueError("sequence parallel: the plan names no blocks (Plan.blocks), the "
                         "layers whose activations it would split along the sequence")
    group, world = mesh.group("tp"), mesh.size("tp")
    return dict(zip(blocks, block_splits(len(blocks), group, world), strict=True))


def stage_modules(model: nn.Module, plan: Plan, stage: Stage,
                  splits: dict[int, SequenceSplit]) -> nn.Sequential:
    """The pipeline's view: every layer, this stage's as :class:`PlannedLayer` modules
    and the others as placeholders."""
    stage.context = ContextCache(plan)
    stage.modules = planned_layers(model, plan, stage.mine, lambda x: splits.get(x.index),
                                   stage.context)
    by_index: dict[int, Any] = {m.layer.index: m for m in stage.modules}
    return nn.Sequential(*[by_index.get(x.index, nn.Identity()) for x in stage.layers])
