"""Every strategy at once, applied in one fixed order to any model on a mesh.

As torchtitan's ``parallelize_*``, and driven by the model's plan
(:mod:`pycomm.parallel.plans.plan`): the model is the same on every rank (built from one
seed, or on the meta device), then, in this order,

1. **pipeline split**: this rank keeps its stage's layers (``pp``); the others go;
2. **tensor parallel** (+ sequence parallelism): the plan's styles turn the stage's
   modules into Megatron's parallel layers over the ``tp`` group (a module the plan
   does not cover is refused); ties are tied again;
3. **weights**: a meta-device model gets them now, only what this rank holds;
4. **activation checkpointing** (+ ``P_a``) of the plan's recompute units;
5. **data parallel or ZeRO** over the ``dp`` group, with fp32 masters under mixed
   precision.

A step then runs the pipeline's schedule over micro-batches, completes the gradients in
:func:`pycomm.parallel.compose.finalize.finalize_grads`'s fixed phases, clips by the norm over
the whole mesh, and steps the optimizer. The global batch is the same on every rank;
each data-parallel replica takes its own rows, so a layout trains the same model as one
process on the whole batch.

Example::

    mesh = ParallelMesh(pp=2, dp=2, tp=2)
    engine = parallelize(model, mesh, ParallelConfig(zero=1, sequence_parallel=True))
    result = engine.train_step(tokens, targets)
"""

from __future__ import annotations

import dataclasses
import inspect

from torch import nn

from ..mesh import ParallelMesh
from ..plans.plan import MODEL_INPUTS, Plan
from .compiled import uncompiled
from .config import ParallelConfig, StepResult
from .engine import ParallelModel
from .materialize import is_meta

__all__ = ["ParallelConfig", "ParallelModel", "StepResult", "parallelize", "plan_for"]


def _known_plans() -> dict[str, str]:
    """Hand-written plans for models whose configs declare none: class -> function."""
    return {"GPT2LMHeadModel": "pycomm.parallel.models.gpt2_plan:gpt2_plan"}


def _is_transformers_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")


def plan_for(model: nn.Module) -> Plan:
    """The plan of ``model``: its own (``model.parallel_plan()``), a known one for its
    class, one derived from a HuggingFace config's ``base_model_tp_plan`` and
    ``base_model_pp_plan``, an ``nn.Sequential``'s children as its layers, or else the
    whole model as one layer (data parallelism and ZeRO need no more: a HuggingFace model
    whose plan cannot be derived, an encoder or a ViT, trains so, and a layout that needs
    its layers is refused quoting why they could not be derived)."""
    import importlib

    own = getattr(model, "parallel_plan", None)
    if callable(own):
        return own()
    known = _known_plans().get(type(model).__name__)
    if known is not None:
        module, _, fn = known.partition(":")
        return getattr(importlib.import_module(module), fn)(model)
    if _is_transformers_model(model):
        from ..models.hf import hf_causal_lm_plan, logits_of

        try:
            return hf_causal_lm_plan(model)
        except ValueError as err:
            return Plan(output=logits_of, inputs=inputs_taken(model), unsplit_reason=str(err),
                        name=type(model).__name__)
    if isinstance(model, nn.Sequential):
        return Plan(layers=[str(i) for i in range(len(model))], name=type(model).__name__)
    return Plan(inputs=inputs_taken(model), name=type(model).__name__)


def inputs_taken(model: nn.Module) -> tuple[str, ...]:
    """The model inputs ``model``'s forward names (a whole model as one layer gets them
    as keywords)."""
    params = inspect.signature(model.forward).parameters
    return tuple(name for name in MODEL_INPUTS if name in params)


def check_layout_needs(plan: Plan, mesh: ParallelMesh, config: ParallelConfig) -> None:
    """Refuses what needs a plan of the model's layers where none could be derived.

    Raises:
        ValueError: naming the settings and quoting why the layers are unknown.
    """
    if not plan.unsplit_reason:
        return
    pp, tp = mesh.size("pp"), mesh.size("tp")
    needs = [what for wanted, what in (
        (pp > 1, f"pp={pp}"), (tp > 1, f"tp={tp}"),
        (config.sequence_parallel, "sequence_parallel"), (config.recompute, "recompute"))
        if wanted]
    if needs:
        raise ValueError(f"parallelize: {', '.join(needs)} needs a plan of {plan.name}'s "
                         f"layers, and none could be derived ({plan.unsplit_reason}); data "
                         "parallelism and ZeRO 1-3 need none")


def parallelize(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig,
                plan: Plan | None = None) -> ParallelModel:
    """Apply every strategy of ``config`` to ``model`` on ``mesh`` (see the module
    docstring for the order). Collective over the world.

    Args:
        model: any ``nn.Module``: the same weights on every rank, or built on the meta
            device (each rank then materializes what it holds, from ``config.seed``).
        mesh: the ``(pp, dp, tp)`` mesh.
        config: the strategies.
        plan: how the model splits (default: :func:`plan_for`).

    Raises:
        ValueError: a combination that cannot work, or a part of the model the layout
            needs and the plan does not cover, named, on every rank before any step.
    """
    model, compiled = uncompiled(model)
    if compiled and not config.compile:
        config = dataclasses.replace(config, compile=True)
    config.check(mesh)
    plan = plan if plan is not None else plan_for(model)
    check_layout_needs(plan, mesh, config)
    if _is_transformers_model(model) and not is_meta(model) and not plan.is_whole_model():
        # A plan's layers must compute what the model's own forward does; checked on a
        # tiny batch while the whole model is still here (a family whose forward the
        # derivation does not reproduce is refused, not trained wrong).
        from .hf_check import check_plan_forward

        check_plan_forward(model, plan)
    return ParallelModel(model, mesh, config, plan)
