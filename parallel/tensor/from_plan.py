"""A plan's tensor-parallel styles applied to this pipeline stage's modules, in place.

Before anything changes, every module the stage holds is checked against the plan: a
module with parameters is either given a style, inside a module a style replaced, or
one of the kinds that are right to leave whole — a norm or an embedding applied to
whole activations. Any other (a ``Linear`` the plan forgot, a norm beside a split
projection that sees this rank's heads only) is refused by path, so nothing is
silently left whole. With sequence parallelism, every parameter left whole inside the
blocks sees this rank's part of the sequence: its gradient is partial, summed over
``tp`` (``tp_partial_grad``).

Sequence parallelism gathers the sequence where a split region begins: at the input of
the module holding a block's column-parallel layers (an attention, an MLP), so that the
module's own code sees whole sequences (it reads shapes from its input) and the
projections share one all-gather; the row-parallel layer that ends the region
reduce-scatters its output back to this rank's part (Megatron-LM's ``g``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plans.plan import Plan, matches, under_any
from . import comms
from .sharding import spec_of
from .styles import (
    Colwise,
    Rowwise,
    Style,
    TPContext,
    VocabHead,
    style_of,
)

_SPLITTING = (Colwise, Rowwise)



def styles_by_path(plan: Plan, model: nn.Module, held: list[str]) -> dict[str, list[Style]]:
    """Each module of the stage (under a path in ``held``) that the plan names, with its
    styles (one that replaces the module at most).

    Raises:
        ValueError: a module two replacing styles name, an unknown style, or a pattern
            that names no module of the model at all (a plan written for another model,
            or a typo: what it was meant for would be left whole).
    """
    paths = [p for p, _ in model.named_modules(remove_duplicate=False)]
    unmatched = [pattern for pattern in plan.tp if not any(matches(pattern, p) for p in paths)]
    if unmatched:
        raise ValueError(f"plan for {plan.name}: tensor-parallel entries {unmatched} match no "
                         f"module of this {type(model).__name__}; the plan is not this "
                         "model's (pass plan= with one that names its modules)")
    out: dict[str, list[Style]] = {}
    for path, _module in model.named_modules(remove_duplicate=False):
        if not under_any(path, held):
            continue
        for pattern, given in plan.tp.items():
            if matches(pattern, path):
                listed = given if isinstance(given, tuple | list) else (given,)
                out.setdefault(path, []).extend(style_of(s, pattern) for s in listed)
    for path, styles in out.items():
        replacing = [s for s in styles if s.changes_module]
        if len(replacing) > 1:
            raise ValueError(f"plan for {plan.name}: {path} is given two styles that each "
                             f"replace it: {replacing}")
    return out


def check_divisible(plan: Plan, world: int) -> None:
    """Raises ValueError naming each count of the plan's ``divisible`` that ``tp`` does
    not divide."""
    bad = [f"{what} = {count}" for what, count in plan.divisible.items() if count % world]
    if bad:
        raise ValueError(f"tensor parallel: {plan.name} has {', '.join(bad)}, not divisible "
                         f"by tp = {world}")


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def check_coverage(plan: Plan, model: nn.Module, held: list[str],
                   styles: dict[str, list[Style]], blocks: list[str]) -> None:
    """Refuses, by path, every parameter-holding module of the stage the plan leaves
    whole where whole is not right (see the module docstring)."""
    replaced = [p for p, s in styles.items() if any(x.changes_module for x in s)]
    splitting = [p for p, s in styles.items() if any(isinstance(x, _SPLITTING) for x in s)]
    for path, module in model.named_modules(remove_duplicate=False):
        if not under_any(path, held) or not list(module.parameters(recurse=False)):
            continue
        if path in styles or under_any(path, replaced):
            continue
        parent = path.rpartition(".")[0]
        beside_split = [p for p in splitting if p.rpartition(".")[0] == parent]
        whole_ok = _is_norm(module) or (isinstance(module, nn.Embedding)
                                         and not under_any(path, blocks))
        if whole_ok and not beside_split:
            continue
        why = (f"it sits beside the split {', '.join(beside_split)} and may see this rank's "
               "part only" if beside_split else "it would be left whole on every rank")
        raise ValueError(f"tensor parallel: the plan for {plan.name} gives no style to {path} "
                         f"({type(module).__name__}): {why}; give it one (colwise, rowwise, "
                         "replicated, partial_grad, ...) in plan.tp")


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and attr.isdigit():
        parent[int(attr)] = new
    else:
        setattr(parent, attr, new)


def _gather_hook(group: Any, path: str, keep_part: bool) -> Callable[..., Any]:
    def gather(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and torch.is_tensor(args[0]):
            whole = comms.gather_sequence_into_region(args[0], group, keep_part)
            return (whole, *args[1:]), kwargs
        if torch.is_tensor(kwargs.get("hidden_states")):
            kwargs["hidden_states"] = comms.gather_sequence_into_region(
                kwargs["hidden_states"], group, keep_part)
            return args, kwargs
        raise TypeError(f"sequence parallel: {path} holds split layers, so it gathers the "
                        "sequence of its input: pass the activations first or as "
                        "hidden_states")
    return gather


def gather_at_regions(model: nn.Module, styles: dict[str, list[Style]], group: Any,
                      blocks: list[str], recompute_gather: bool = True) -> None:
    """Sequence parallelism: each module holding a block's column-parallel layers gathers
    its input's sequence (see the module docstring); with ``recompute_gather`` those
    layers keep this rank's part for backward and gather it again there.

    Raises:
        ValueError: a column-parallel layer that is a block itself, or the block's child
            (its region would hold the block's residual stream).
    """
    regions = sorted({p.rpartition(".")[0] for p, s in styles.items()
                      if under_any(p, blocks) and any(isinstance(x, Colwise) for x in s)})
    for region in regions:
        if region in blocks or not under_any(region, blocks):
            raise ValueError(f"sequence parallel: the split layers under {region or '<root>'} "
                             "are the block's own children; the gather before them would "
                             "take in the block's residual stream: keep them in a module "
                             "(an attention, an MLP) inside the block")
        model.get_submodule(region).register_forward_pre_hook(
            _gather_hook(group, region, recompute_gather), with_kwargs=True)


def apply_styles(model: nn.Module, styles: dict[str, list[Style]], group: Any,
                 blocks: list[str], sequence_parallel: bool, parallel_loss: bool,
                 materialize: Callable[[str, nn.Module], None],
                 experts_by_ep: bool = False, recompute_gather: bool = True) -> bool:
    """Apply every style, deepest modules first; ``materialize(path, module)`` first
    gives a module on the meta device its weights (``experts_by_ep``: fused experts are
    left whole, for expert parallelism; ``recompute_gather``: see
    :func:`gather_at_regions`). Returns whether an LM head was split over the
    vocabulary with split logits (the loss must then be vocab-parallel)."""
    world, split_logits = dist.get_world_size(group), False
    if sequence_parallel:
        gather_at_regions(model, styles, group, blocks, recompute_gather)
    for path in sorted(styles, key=lambda p: -p.count(".")):
        module = model.get_submodule(path)
        if any(s.changes_module for s in styles[path]):
            materialize(path, module)
        # Colwise layers get the region's gathered input; rowwise ones scatter it back.
        in_blocks = sequence_parallel and under_any(path, blocks)
        colwise = any(isinstance(s, Colwise) for s in styles[path])
        ctx = TPContext(group, world, path, in_blocks and not colwise, parallel_loss,
                        input_gathered=in_blocks and colwise, experts_by_ep=experts_by_ep)
        for style in sorted(styles[path], key=lambda s: not s.changes_module):
            new = style.apply(module, ctx)
            if new is not module:
                _replace(model, path, new)
                module = new
            split_logits |= isinstance(style, VocabHead) and parallel_loss
    return split_logits


def mark_partial_grads(model: nn.Module, held: list[str], blocks: list[str],
                       sequence_parallel: bool) -> None:
    """With sequence parallelism, every parameter left whole inside the blocks gets a
    partial gradient on each rank (see the module docstring)."""
    if not sequence_parallel:
        return
    for path, module in model.named_modules(remove_duplicate=False):
        if not (under_any(path, held) and under_any(path, blocks)):
            continue
        for p in module.parameters(recurse=False):
            if spec_of(p).dim is None:
                p.tp_partial_grad = True


def partial_grad_params(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters whose gradient is a sum over ``tp`` of each rank's part."""
    return [p for p in params if getattr(p, "tp_partial_grad", False)
            or getattr(p, "sequence_parallel", False)]
