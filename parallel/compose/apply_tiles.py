"""ZeRO-3's ``max_unit_bytes`` applied to this stage: every layer outside the blocks
holding more parameters than it allows is replaced by its tiles
(:mod:`pycomm.parallel.compose.tiles`), in the stage's modules and in the model, and the
tiles become units of their own.

A layer still on the meta device is cut into tiles on the meta device, and each tile
gets its weights when ZeRO-3 shards it (:class:`RowsSource`): the layer's weights are
made whole when its first tile asks (the one process's weights, so every layout starts
from them) and dropped once its last tile has taken its rows, so no rank holds more
than one layer whole, as without tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plans.plan import under_any
from .materialize import Materializer, is_meta
from .tiles import TiledLinear, tiled


@dataclass
class Tiles:
    """What tiling made: the tile modules (each a unit), and the vocabulary chunks of
    the stage's last layer's head, if it was tiled (the loss is taken in them)."""

    units: list[nn.Module] = field(default_factory=list)
    head_bounds: list[tuple[int, int]] | None = None


class RowsSource:
    """A meta-device layer its tiles take their rows from (see the module docstring)."""

    def __init__(self, path: str, layer: nn.Module, tiles: list[nn.Module]):
        self.path, self.waiting = path, len(tiles)
        self.layer: nn.Module | None = layer
        for tile in tiles:
            tile.__dict__["materialize_rows"] = self._filler(tile)

    def _filler(self, tile: nn.Module) -> Any:
        return lambda materializer: self.fill(tile, materializer)

    @torch.no_grad()
    def fill(self, tile: Any, materializer: Materializer) -> None:
        """``tile``'s parameters: its rows of the layer's, materialized if need be."""
        if not any(p.is_meta for p in tile._parameters.values() if p is not None):
            return  # filled already
        if self.layer is None:
            raise RuntimeError(f"ZeRO-3 tiles: {self.path}'s tiles were all materialized")
        if is_meta(self.layer):
            materializer(self.path, self.layer)
        for name, meta in list(tile._parameters.items()):
            if meta is None or not meta.is_meta:
                continue
            whole = getattr(self.layer, name)
            made = nn.Parameter(whole[tile.start:tile.stop].clone(),
                                requires_grad=meta.requires_grad)
            made.__dict__.update(meta.__dict__)  # row_slice
            tile._parameters[name] = made
        self.waiting -= 1
        if self.waiting == 0:
            self.layer = None  # its whole weights go


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
                new = tiled(layer, path, max_numel)
                assert new is not None  # its own parameters exceed max_numel
                if is_meta(layer):
                    RowsSource(path, layer, list(new.tiles))
                _replace(model, planned, k, path, inner, new)
                made.units.extend(new.tiles)
                last = index == len(stage.modules) - 1
                if isinstance(new, TiledLinear) and last:
                    made.head_bounds = new.bounds
    return made
