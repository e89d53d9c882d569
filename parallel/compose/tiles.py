"""A layer too large to gather whole, split into tiles that ZeRO-3 gathers one at a time
(DeepSpeed's ``TiledLinear``): an embedding by rows of its vocabulary, an LM head by its
output rows (chunks of the vocabulary).

Each tile is a module of its own holding rows ``[start, stop)`` of the layer's weight
(and bias), and so a ZeRO-3 unit of its own; the tiled module computes what the layer
computed:

- the embedding looks each token up in the one tile holding its row, every other tile
  passing the result through (``torch.where``, no sum: the output and the weight's
  gradient are the untiled layer's bit for bit);
- the head computes each tile's logits and concatenates them; the loss over them is
  taken in the same vocabulary chunks (:mod:`pycomm.parallel.compose.chunked_loss`), never
  holding a float32 copy of the whole logits.

Checkpoints, pretrained weights and the HuggingFace export see the layer's own tensors:
each tile's parameter is named after the layer's (``original_names``) and carries the
place of its rows in it (``row_slice``, as expert parallelism's slices do).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def row_bounds(rows: int, per_row: int, max_numel: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the fewest tiles of at most ``max_numel`` elements each
    (``per_row`` elements a row), their sizes differing by at most one row."""
    most_rows = max(1, max_numel // max(per_row, 1))
    count = math.ceil(rows / most_rows)
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for k in range(count):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _rows_of(whole: torch.Tensor, start: int, stop: int) -> nn.Parameter:
    """Rows ``[start, stop)`` of ``whole``, a parameter that knows its place in it."""
    part = nn.Parameter(whole.detach()[start:stop].clone(), requires_grad=whole.requires_grad)
    part.row_slice = (start, whole.shape[0])  # type: ignore[attr-defined]
    return part


class EmbeddingTile(nn.Module):
    """Rows ``[start, stop)`` of an embedding; looks up the tokens among them and passes
    ``before`` (the earlier tiles' result) through for the others."""

    def __init__(self, whole: nn.Embedding, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.weight = _rows_of(whole.weight, start, stop)
        pad = whole.padding_idx
        self.padding_idx = pad - start if pad is not None and start <= pad < stop else None

    def forward(self, ids: torch.Tensor, before: torch.Tensor | None) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.stop - self.start)
        rows = F.embedding(local.clamp(0, self.stop - self.start - 1), self.weight,
                           self.padding_idx)
        if before is None:
            before = torch.zeros((), dtype=rows.dtype, device=rows.device)
        return torch.where(inside.unsqueeze(-1), rows, before)


class TiledEmbedding(nn.Module):
    """An ``nn.Embedding`` as :class:`EmbeddingTile` s (see the module docstring)."""

    def __init__(self, whole: nn.Embedding, bounds: list[tuple[int, int]]):
        super().__init__()
        self.num_embeddings, self.embedding_dim = whole.num_embeddings, whole.embedding_dim
        self.padding_idx = whole.padding_idx
        self.tiles = nn.ModuleList(EmbeddingTile(whole, a, b) for a, b in bounds)
        self.original_names = {f"tiles.{k}.weight": "weight" for k in range(len(bounds))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for tile in self.tiles:
            out = tile(ids, out)
        assert out is not None
        return out


class LinearTile(nn.Module):
    """Output rows ``[start, stop)`` of a linear layer."""

    def __init__(self, whole: nn.Linear, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.weight = _rows_of(whole.weight, start, stop)
        self.bias = None if whole.bias is None else _rows_of(whole.bias, start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class TiledLinear(nn.Module):
    """An ``nn.Linear`` (an LM head) as :class:`LinearTile` s; ``bounds``: each tile's
    output rows, the chunks the loss is taken in."""

    def __init__(self, whole: nn.Linear, bounds: list[tuple[int, int]]):
        super().__init__()
        self.in_features, self.out_features = whole.in_features, whole.out_features
        self.bounds = bounds
        self.tiles = nn.ModuleList(LinearTile(whole, a, b) for a, b in bounds)
        fields = ["weight"] + (["bias"] if whole.bias is not None else [])
        self.original_names = {f"tiles.{k}.{f}": f for k in range(len(bounds)) for f in fields}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)


def tiled(module: nn.Module, path: str, max_numel: int
          ) -> TiledEmbedding | TiledLinear | None:
    """``module`` as tiles of at most ``max_numel`` elements each, or None where it is
    that small already.

    Raises:
        TypeError: naming the module, if it is larger and not a plain ``nn.Embedding`` or
            ``nn.Linear`` (one it cannot split, or one whose options make rows depend on
            each other: ``max_norm``, ``scale_grad_by_freq``, ``sparse``).
    """
    numel = sum(p.numel() for p in module.parameters())
    if numel <= max_numel:
        return None
    if type(module) is nn.Embedding and module.max_norm is None \
            and not module.scale_grad_by_freq and not module.sparse:
        return TiledEmbedding(module, row_bounds(module.num_embeddings, module.embedding_dim,
                                                 max_numel))
    if type(module) is nn.Linear:
        per_row = module.in_features + (module.bias is not None)
        return TiledLinear(module, row_bounds(module.out_features, per_row, max_numel))
    raise TypeError(f"ZeRO-3 tiles: {path} ({type(module).__name__}, {numel:,} parameters) is "
                    f"larger than max_unit_bytes allows ({max_numel:,}) and is not a plain "
                    "nn.Embedding or nn.Linear, the layers that split into tiles; raise "
                    "max_unit_bytes above its size")
