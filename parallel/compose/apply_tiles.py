"""ZeRO-3's ``max_unit_bytes`` applied to this stage: every layer outside the blocks
holding more parameters than it allows is replaced by its tiles
(:mod:`parallel.compose.tiles`), in the stage's modules and in the model, and the
tiles become units of their own.

A layer still on the meta device gets its weights first, whole (the one process's
weights, so every layout starts from them), and is dropped once its tiles hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from parallel.compose.materialize import is_meta
from parallel.compose.plan import under_any
from parallel.compose.tiles import TiledLinear, tiled


@dataclass
class Tiles:
    """What tiling made: the tile modules (each a unit), and the vocabulary chunks of
    the stage's last layer's head, if it was tiled (the loss is taken in them)."""

    units: list[nn.Module] = field(default_factory=list)
    head_bounds: list[tuple[int, int]] | None = None


def _refuse_tied(path: str, module: nn.Module, canonical: dict[str, str]) -> None:
    tied = set(canonical) | set(canonical.values())
    names = [f"{path}.{n}" for n, _ in module.named_parameters()]
    if hit := [n for n in names if n in tied]:
        raise ValueError(f"ZeRO-3 tiles: {hit[0]} is tied to another parameter "
                         f"({sorted(a for a, c in canonical.items() if c in hit or a in hit)}); "
                         "a tied layer cannot be split into tiles (untie it, or raise "
                         "max_unit_bytes above its size)")


def _large_layers(layer_path: str, module: nn.Module, blocks: list[str], max_numel: int
                  ) -> list[tuple[str, str]]:
    """(model path, path inside ``module``) of each module outside the blocks whose own
    parameters exceed ``max_numel``."""
    out = []
    for inner, sub in module.named_modules():
        path = ".".join(p for p in (layer_path, inner) if p)
        own = sum(p.numel() for p in sub.parameters(recurse=False))
        if own > max_numel and not under_any(path, blocks):
            out.append((path, inner))
    return out


def _replace(model: nn.Module, planned: Any, k: int, path: str, inner: str,
             new: nn.Module) -> None:
    if inner:
        parent, _, attr = inner.rpartition(".")
        setattr(planned.mods[k].get_submodule(parent), attr, new)
    else:
        planned.mods[k] = new
    parent, _, attr = path.rpartition(".")
    owner = model.get_submodule(parent)
    if getattr(owner, attr, None) is not None:  # a layer the model reaches by path
        setattr(owner, attr, new)


def tile_large_layers(model: nn.Module, stage: Any, max_numel: int) -> Tiles:
    """Split this stage's large layers (see the module docstring).

    Raises:
        TypeError: a large layer that is not a plain ``nn.Embedding`` or ``nn.Linear``.
        ValueError: a large layer holding a tied parameter.
    """
    made = Tiles()
    for index, planned in enumerate(stage.modules):
        for k, mod in enumerate(planned.mods):
            for path, inner in _large_layers(planned.layer.paths[k], mod, stage.blocks,
                                             max_numel):
                layer = mod.get_submodule(inner)
                _refuse_tied(path, layer, stage.canonical)
                if is_meta(layer):
                    stage.materializer(path, layer)
                new = tiled(layer, path, max_numel)
                assert new is not None  # its own parameters exceed max_numel
                _replace(model, planned, k, path, inner, new)
                made.units.extend(new.tiles)
                last = index == len(stage.modules) - 1
                if isinstance(new, TiledLinear) and last:
                    made.head_bounds = new.bounds
    return made
