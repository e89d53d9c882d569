"""``torch.compile`` with the other strategies: each block compiled in place, as
torchtitan's ``apply_compile`` does, after tensor parallelism, recompute and ZeRO are
applied.

What is compiled is the modules a block layer runs (a ``LlamaDecoderLayer``, the GPT's
``Block``), not the :class:`~pycomm.parallel.compose.layers.PlannedLayer` around them: the
sequence-parallel split and gather, activation checkpointing and ZeRO-3's gather hooks
act on the planned layer and stay eager, and identical blocks share one compiled graph.
A model compiled before ``parallelize`` (``torch.compile(model)``) is taken apart by
:func:`uncompiled` and its blocks compiled so instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def compile_blocks(stage: Any) -> int:
    """Compile, in place, the modules of this stage's block layers (of every layer where
    the plan names no blocks: a model trained whole); returns how many."""
    has_blocks = any(layer.is_block for layer in stage.layers)
    count = 0
    for planned in stage.modules:
        if has_blocks and not planned.layer.is_block:
            continue
        for module in planned.mods:
            module.compile()
            count += 1
    return count


def uncompiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module ``torch.compile(model)`` wrapped, and whether it was wrapped."""
    original = getattr(model, "_orig_mod", None)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and original is not None:
        log.info("parallelize: %s was compiled whole; its blocks are compiled one by one "
                 "instead (ParallelConfig(compile=True))", type(original).__name__)
        return original, True
    return model, False
