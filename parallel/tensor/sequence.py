"""Sequence parallelism's place in a model: which blocks split their input along the
sequence, which gather their output, and the random stream between.

Between the first block's split and the last block's gather, everything outside the
split regions (norms, residuals, dropout) works on ``1/TP`` of the tokens, and every
random draw there is the rank's own (Megatron-LM): each rank drops its own tokens.
What follows the last block runs whole on every rank, so its gradient is whole, not
partial. The same :func:`on_sequence_part` runs a pipeline stage's planned layers
(:mod:`pycomm.parallel.compose.layers`) and a model converted in place
(:func:`split_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torch import nn

from ..rng import TENSOR_PARALLEL, TRACKER
from . import comms


class SequenceSplit:
    """Sequence parallelism's place in a layer: whether it splits its input along the
    sequence first, gathers its output after, and whether it works on a split at all."""

    def __init__(self, group: Any, world: int, inside: bool, scatter: bool, gather: bool):
        self.group, self.world = group, world
        self.inside, self.scatter, self.gather = inside, scatter, gather


def on_sequence_part(split: SequenceSplit | None, run: Callable[[Any], Any], x: Any) -> Any:
    """``run(x)`` where ``split`` puts it: split first, on the per-rank stream while
    inside, gathered after."""
    inside = split is not None and split.inside
    if split is not None and split.scatter:
        x = comms.scatter_to_sequence_region(x, split.group)
    with TRACKER.fork(TENSOR_PARALLEL) if inside else nullcontext():
        x = run(x)
    if split is not None and split.gather:
        # what follows runs whole on every rank: its gradient is whole, not partial
        x = comms.gather_from_sequence_region(x, split.group, grad_is_partial=False)
    return x


def block_splits(count: int, group: Any, world: int) -> list[SequenceSplit]:
    """The splits of ``count`` consecutive blocks: the first splits, the last gathers."""
    return [SequenceSplit(group, world, True, i == 0, i == count - 1) for i in range(count)]


def split_blocks(model: nn.Module, blocks: list[str], group: Any, world: int) -> None:
    """Each of the ``blocks`` (module paths, in forward order) runs on this rank's part of
    the sequence, in place: the first splits its input, the last gathers its output.
    The block's first argument is its activations; the others pass through."""
    for path, split in zip(blocks, block_splits(len(blocks), group, world), strict=True):
        block = model.get_submodule(path)
        block.forward = _on_part(block.forward, split)


def _on_part(forward: Callable[..., Any], split: SequenceSplit) -> Callable[..., Any]:
    def forward_on_part(x: Any, *args: Any, **kwargs: Any) -> Any:
        return on_sequence_part(split, lambda y: forward(y, *args, **kwargs), x)
    return forward_on_part
