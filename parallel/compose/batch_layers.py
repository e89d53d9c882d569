"""Layers that see the whole batch, in every layout: BatchNorm over the whole
data-parallel batch (or refused where no layer sees it), the routers' load-balancing
statistics over the global batch (:mod:`pycomm.parallel.moe.balance`), and the experts'
capacity with the count of what it dropped (:mod:`pycomm.parallel.moe.capacity`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data.sync_batchnorm import batchnorm_paths, sync_batchnorm
from ..moe.balance import RoutingStats, track_router
from ..moe.capacity import DropCounter, limit_capacity
from ..plans.plan import matching, under_any


def batchnorm_over_batch(engine: Any) -> None:
    """BatchNorm over the whole data-parallel batch (``config.sync_batchnorm``), or
    refused where no layer could see it."""
    paths = batchnorm_paths(engine.stage)
    if not paths or not engine.config.sync_batchnorm:
        return
    config = engine.config
    blocked = [what for bad, what in (
        (config.microbatches > 1, f"microbatches={config.microbatches} (each micro-batch "
         "would be normalised alone)"),
        (config.sequence_parallel, "sequence_parallel (a rank holds part of the sequence)"),
        (config.recompute, "recompute (a recomputed forward would update the running "
         "statistics twice)"))
        if bad]
    if blocked:
        raise ValueError(
            f"parallelize: the model's BatchNorm layers ({', '.join(paths[:3])}) normalise "
            f"over their batch, which no layer sees whole with {'; '.join(blocked)}, so "
            "the layout would train another model than one process; change that setting, "
            "or set sync_batchnorm=False to normalise each micro-batch and replica alone")
    if engine.mesh.size("dp") > 1:
        sync_batchnorm(engine.stage, engine.mesh.group("dp"))


def routing_stats(engine: Any) -> RoutingStats | None:
    """The load-balancing loss of the plan's routers, over the whole global batch
    (:mod:`pycomm.parallel.moe.balance`): the statistics are complete before any backward
    only when every forward of the step comes first.

    Raises:
        ValueError: micro-batches under the 1F1B schedule.
    """
    balance = engine.plan.balance
    if balance is None:
        return None
    config = engine.config
    if config.microbatches > 1 and config.schedule != "gpipe":
        raise ValueError(
            f"parallelize: {engine.plan.name}'s load-balancing loss counts the routing of "
            f"the whole batch, and with microbatches={config.microbatches} the "
            f"{config.schedule} schedule starts a backward before the last forward; use "
            "schedule='gpipe' (or one micro-batch)")
    context = engine.stage_plan.context

    def mask() -> torch.Tensor | None:
        inputs = context.inputs if context is not None else None
        return inputs.attention_mask if inputs is not None else None

    stats = RoutingStats(balance.experts, balance.top_k, balance.coef,
                         counts=engine.mesh.rank("tp") == 0 or config.sequence_parallel,
                         replicas=engine.mesh.size("dp"), mask=mask)
    for path in matching(balance.routers, engine.stage_plan.materializer.root):
        if under_any(path, engine.stage_plan.held):
            track_router(engine.stage_plan.materializer.root.get_submodule(path), stats)
    engine.pipeline.before_backward = stats.finish
    return stats


def expert_capacity(engine: Any, model: nn.Module) -> DropCounter | None:
    """The configured capacity on every experts module of the stage (after expert or
    tensor parallelism split them; :mod:`pycomm.parallel.moe.capacity`), and its counter.

    Raises:
        ValueError: a capacity for a model whose plan names no experts.
    """
    config, plan = engine.config, engine.plan
    if config.capacity_factor is None:
        return None
    if plan.experts is None:
        raise ValueError(f"parallelize: capacity_factor={config.capacity_factor} limits a "
                         f"mixture of experts' experts, and the plan for {plan.name} names "
                         "none (Plan.experts)")
    counter = DropCounter(counts=engine.mesh.rank("tp") == 0 or config.sequence_parallel)
    for path in matching(plan.experts, model):
        if under_any(path, engine.stage_plan.held):
            module = model.get_submodule(path)
            experts: Any = getattr(module, "experts_total", None) or module.num_experts
            limit_capacity(module, experts, config.capacity_factor, config.drop_policy,
                           counter)
    return counter
