"""Activation checkpointing of a pipeline stage's recompute units, from the plan: the
modules its patterns name (the blocks, by default). A recompute asked for where the plan
names no unit is refused, not skipped."""

from __future__ import annotations

from typing import Any

from ..plans.plan import Plan, matches, planned_units
from .apply import checkpoint_module


def checkpoint_units(plan: Plan, stage: Any, partition_group: Any) -> None:
    """Checkpoint every recompute unit of the stage (``partition_group``: P_a).

    Raises:
        ValueError: the plan names no recompute unit in the model.
    """
    patterns = plan.recompute_patterns()
    model = stage.materializer.root
    if not any(matches(pat, path) for pat in patterns
               for path, _ in model.named_modules(remove_duplicate=False)):
        raise ValueError(f"recompute: the plan for {plan.name} names no recompute units "
                         f"(Plan.recompute, or Plan.blocks: {plan.blocks!r}); nothing would be "
                         "checkpointed")
    for module in planned_units(patterns, stage.modules, model):
        checkpoint_module(module, partition_group=partition_group)
