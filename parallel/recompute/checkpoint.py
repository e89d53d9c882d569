"""Activation checkpointing with partitioned (P_a) or offloaded inputs, RNG replayed.

:func:`checkpoint` runs ``fn`` under ``no_grad`` and keeps only its tensor inputs; in
backward it replays every random generator as the forward found it (torch's CPU and
CUDA generators and every stream of :data:`pycomm.parallel.rng.TRACKER`), reruns ``fn`` with
gradients and backpropagates through the rerun. The kept inputs go to a
:class:`CheckpointArena`.

With ``partition_group`` each rank keeps ``1/N`` of each input (ZeRO-R's P_a, see
:mod:`pycomm.parallel.recompute.partition`); with ``offload`` a CUDA input waits in (pinned)
host memory; a CPU input already is there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..rng import TRACKER
from .partition import Stored, check_identical_inputs
from .saved_inputs import CheckpointArena

_DEFAULT_ARENA = CheckpointArena()
_REPLAYS = [0]  # reruns in progress (a rerun may hold another checkpoint's)


def replaying() -> bool:
    """Whether a checkpointed forward is being rerun for its backward (what a forward
    counts, it counted the first time)."""
    return _REPLAYS[0] > 0


def default_arena() -> CheckpointArena:
    """The arena :func:`checkpoint` uses when none is given."""
    return _DEFAULT_ARENA


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], options: dict[str, Any], *args: Any) -> Any:
        ctx.fn, ctx.rng = fn, TRACKER.snapshot()
        ctx.args = [Stored(a, options["group"], options["offload"], options["arena"])
                    if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        inputs = [a.load() if isinstance(a, Stored) else a for a in ctx.args]
        # the forward's random draws again (dropout masks, on every stream)
        _REPLAYS[0] += 1
        try:
            with TRACKER.replay(ctx.rng), torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _REPLAYS[0] -= 1
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for a in ctx.args:
            if isinstance(a, Stored):
                a.release()
        input_grads = [a.grad if torch.is_tensor(a) and a.requires_grad else None
                       for a in inputs]
        return (None, None, *input_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, partition_group: Any = None,
               offload: bool = False, arena: CheckpointArena | None = None) -> Any:
    """``fn(*args)`` keeping only ``args`` (see the module docstring).

    Args:
        fn: returns a tensor or a tuple of tensors; non-tensor ``args`` pass through.
        partition_group: keep ``1/size`` of each tensor input on each rank of this group
            (every rank must pass the same inputs: a tensor-parallel group without
            sequence parallelism; checked at ``fn``'s first call).
        offload: keep CUDA inputs in host memory.
        arena: where inputs are kept (default: one shared arena).

    Raises:
        ValueError: with ``partition_group``, if the inputs differ across its ranks.
    """
    if partition_group is not None:
        check_identical_inputs(fn, args, partition_group)
    options = {"group": partition_group, "offload": offload,
               "arena": arena if arena is not None else _DEFAULT_ARENA}
    return _Checkpoint.apply(fn, options, *args)
