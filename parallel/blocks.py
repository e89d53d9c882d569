"""A model's repeated blocks: what ZeRO-3 gathers as one unit and recomputation replays
as one segment by default, found by the model's structure alone (the ground floor: both
strategies ask it, neither owns it)."""

from __future__ import annotations

from torch import nn


def default_unit_modules(model: nn.Module) -> list[nn.Module]:
    """Every child of every ``nn.ModuleList`` (outermost lists only), in module order."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units
