"""Which parameters stage 3 gathers together (one unit per layer, plus the small ones),
and the :class:`Unit` each becomes.

A unit is the set of parameters one all-gather brings in before a module's forward (and
again before its backward) and frees after. By default every child of an
``nn.ModuleList`` (a transformer's blocks) is a unit, and the model itself is one for
the parameters no block owns (embeddings, final norm, head), as FSDP is usually
wrapped. Parameters smaller than the persistence threshold (biases, norms) go to one
persistent unit instead: gathered once per step and kept, because an all-gather per
tiny tensor would cost more in latency than the memory it saves (DeepSpeed's
``stage3_param_persistence_threshold``).

A tied parameter (one tensor reached by two names, an LM head sharing the embedding)
belongs to the unit that holds both of its users, and is gathered once for both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..blocks import default_unit_modules
from .shard_layout import ShardLayout


@dataclass
class UnitPlan:
    """A unit's module (whose forward gathers it) and its parameters' qualified names."""

    module: nn.Module
    names: list[str] = field(default_factory=list)
    persistent: bool = False
    aliases: dict[str, list[str]] = field(default_factory=dict)  # name -> its other names


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """The first name of every parameter reached by several names -> the others."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def plan_units(model: nn.Module, unit_modules: Iterable[nn.Module] | None,
               persistence_threshold: int, never_persistent: Iterable[str] = (),
               exclude: Iterable[str] = ()) -> list[UnitPlan]:
    """The units in module order: the model's own unit first, the persistent unit last.
    ``never_persistent``: names that stay in their module's unit whatever their size;
    ``exclude``: names left out of every unit (whole, another optimizer's).

    Raises:
        ValueError: if a parameter is shared between modules of different units, or a
            unit module is not part of ``model``.
    """
    modules = default_unit_modules(model) if unit_modules is None else list(unit_modules)
    prefix_of = {id(m): name for name, m in model.named_modules()}
    if stray := [type(m).__name__ for m in modules if id(m) not in prefix_of]:
        raise ValueError(f"shard_model: unit modules {stray} are not part of the model")
    plans = {id(model): UnitPlan(model)}
    plans.update({id(m): UnitPlan(m) for m in modules if m is not model})
    persistent = UnitPlan(model, persistent=True)
    aliases, keep, seen = _aliases(model), set(never_persistent), set()
    left_out = set(exclude)
    for module_name, module in model.named_modules():
        owner = _innermost_unit(model, module_name, plans, prefix_of)
        for param_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # a tie's other names: its aliases
                continue
            seen.add(id(p))
            name = f"{module_name}.{param_name}" if module_name else param_name
            if name in left_out:
                continue
            small = p.numel() < persistence_threshold and name not in keep
            unit = persistent if small else _shared_owner(model, name, aliases, owner, plans,
                                                          prefix_of)
            unit.names.append(name)
            if name in aliases:
                unit.aliases[name] = aliases[name]
    units = [p for p in plans.values() if p.names]
    return units + ([persistent] if persistent.names else [])


def _shared_owner(model: nn.Module, name: str, aliases: dict[str, list[str]], owner: UnitPlan,
                  plans: dict[int, UnitPlan], prefix_of: dict[int, str]) -> UnitPlan:
    """The unit of a parameter: every one of its names must be in the same unit."""
    others = {id(_innermost_unit(model, a.rpartition(".")[0], plans, prefix_of)): a
              for a in aliases.get(name, [])}
    if any(k != id(owner) for k in others):
        raise ValueError(f"shard_model: parameter {name!r} is the same tensor as "
                         f"{sorted(others.values())}, used by modules of another unit; a tied "
                         "parameter must lie in one unit (make a module holding both users "
                         "the unit, or raise persistence_threshold above its size)")
    return owner


def _innermost_unit(model: nn.Module, module_name: str, plans: dict[int, UnitPlan],
                    prefix_of: dict[int, str]) -> UnitPlan:
    """The unit of the deepest unit module that contains ``module_name``."""
    best, depth = plans[id(model)], -1
    for key, plan in plans.items():
        prefix = prefix_of[key]
        inside = prefix == "" or module_name == prefix or module_name.startswith(prefix + ".")
        if inside and prefix.count(".") + (prefix != "") > depth:
            best, depth = plan, prefix.count(".") + (prefix != "")
    return best


class Unit:
    """One unit: its parameters, where they sit in the unit's flat buffer, its shard."""

    def __init__(self, index: int, plan: UnitPlan, params: list[nn.Parameter], ids: list[int],
                 layout: ShardLayout, k: int):
        self.index, self.module, self.persistent = index, plan.module, plan.persistent
        self.names, self.params, self.ids = plan.names, params, ids
        span = layout.buckets[k]
        self.shard_numel = span.shard
        self.full_numel = span.shard * layout.world
        self.offsets = [layout.offsets[i] - span.start for i in ids]
        self.position = {i: j for j, i in enumerate(ids)}  # global index -> place in the unit
        self.shapes = [p.shape for p in params]  # kept: the parameters become empty
        self.homes: list[torch.Tensor] = []  # full-shape tensors bound to the gathered slot
        self.shard: nn.Parameter  # master values of this rank's shard
        self.comm_shard: torch.Tensor  # the shard in the compute dtype (the same tensor in fp32)
        self.slot: torch.Tensor | None = None  # the gathered unit, while it is in memory
        self.pending: Any = None  # a gather in flight
        self.bound = False  # the parameters point into ``slot``

    def piece(self, buffer: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter ``j``'s elements in a whole-unit buffer."""
        return buffer[self.offsets[j] : self.offsets[j] + self.shapes[j].numel()]
