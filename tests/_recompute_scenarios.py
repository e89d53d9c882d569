"""The TP = 2 job of tests/test_recompute.py: P_a against plain checkpointing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
from pycomm.parallel.recompute import CheckpointArena, apply_activation_checkpointing
from pycomm.parallel.tensor import apply_tensor_parallel, gather_tensor_parallel_state_dict

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32, dropout=0.0)
ROWS = 4


def _grads(partition: bool | None) -> dict[str, Any]:
    """Gradients of one step: no checkpointing (None), or every block checkpointed with
    (True) or without (False) its input partitioned across the TP group."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    net = apply_tensor_parallel(GPT(CFG), group, parallel_output=False)
    arena = CheckpointArena()
    if partition is not None:
        apply_activation_checkpointing(net, "every", arena=arena,
                                       partition_group=group if partition else None)
    x, y = synthetic_batch(CFG, ROWS, seed=3)
    lm_loss(net(x), y).backward()
    return {"grads": gather_tensor_parallel_state_dict(net, grads=True),
            "arena_peak": arena.stats()["peak_bytes"]}


def run_all(world: int) -> dict[Any, Any]:
    return {mode: _grads(mode) for mode in (None, False, True)}
