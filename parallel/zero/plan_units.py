"""ZeRO-3's gather units of a pipeline stage, from the plan: the modules its patterns
name (the blocks, by default), a tie across stages alone, and (offloaded) each large
layer outside them."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..plans.plan import Plan, planned_units

OWN_UNIT_NUMEL = 1 << 20  # offloaded: a layer this large outside the blocks is a unit


def zero3_units(plan: Plan, stage: Any, ties: Any, names: Any, own_large_layers: bool = False
                ) -> tuple[list[nn.Module], tuple[str, ...]]:
    """ZeRO-3's unit modules, and the parameters kept out of the persistent unit: a tie
    across pipeline stages is a unit of its own on every stage holding it (so its shards
    line up there). ``own_large_layers``: so is every layer outside them holding
    :data:`OWN_UNIT_NUMEL` parameters or more and no parameter of another layer (an
    embedding, an untied head), so it is gathered only around its own use rather than
    with the model's unit for the whole step.

    Raises:
        ValueError: a tie across stages whose module holds other parameters too.
    """
    model = stage.materializer.root
    units = planned_units(plan.zero3_patterns(), stage.modules, model)
    keep = []
    for path, module, p in _tied_owners(stage, ties, names):
        others = [n for n, q in module.named_parameters() if q is not p]
        if others:
            raise ValueError(f"ZeRO-3: {names.of(p)} is tied across pipeline stages, and its "
                             f"module holds {others} too; it must be alone in its module")
        units.append(module)
        keep.append(path)
    if own_large_layers:
        units += _large_layers(stage, units)
    return units, tuple(keep)


def _large_layers(stage: Any, units: list[nn.Module]) -> list[nn.Module]:
    """The stage's planned layers, not inside a unit already, holding
    :data:`OWN_UNIT_NUMEL` parameters or more, none shared with another layer."""
    owners: dict[int, int] = {}
    for planned in stage.modules:
        for p in planned.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    inside = {id(m) for unit in units for m in unit.modules()}
    out = []
    for planned in stage.modules:
        params = list(planned.parameters())
        big = sum(p.numel() for p in params) >= OWN_UNIT_NUMEL
        alone = all(owners[id(p)] == 1 for p in params)
        if big and alone and id(planned) not in inside:
            out.append(planned)
    return out


def _tied_owners(stage: Any, ties: Any, names: Any) -> list[tuple[str, nn.Module, Any]]:
    """(stage path, owning module, parameter) of this rank's copies of cross-stage ties."""
    out = []
    seq = nn.Sequential(*stage.modules)
    tied = {n for n, _, g in ties.ties if g is not None}
    for path, p in seq.named_parameters():
        if names.model_name(path) in tied:
            out.append((path, seq.get_submodule(path.rpartition(".")[0]), p))
    return out
