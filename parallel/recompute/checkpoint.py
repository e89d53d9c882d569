"""Activation checkpointing with partitioned (P_a) or offloaded inputs, RNG replayed.

:func:`checkpoint` runs ``fn`` under ``no_grad`` and keeps only its tensor inputs; in
backward it restores every random stream to where it was (torch's CPU and CUDA
generators and :data:`parallel.tensor.random.TRACKER`), reruns ``fn`` with gradients and
backpropagates through the rerun. The kept inputs go to a :class:`CheckpointArena`.

ZeRO-R's ``P_a``: inside a tensor-parallel region every TP rank holds the same block
input, so keeping it on each rank wastes ``TP - 1`` copies. With ``partition_group``
each rank keeps ``1/TP`` of it and the whole is all-gathered just before the
recomputation. With ``offload`` a CUDA input waits in (pinned) host memory; a CPU input
already is there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallel.recompute.arena import CheckpointArena
from parallel.tensor.random import TRACKER

_DEFAULT_ARENA = CheckpointArena()
# torch 2.13 renamed the tensor form (the old name warns); older torch has only that.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def default_arena() -> CheckpointArena:
    """The arena :func:`checkpoint` uses when none is given."""
    return _DEFAULT_ARENA


class _Stored:
    """One input as kept: whole, or this rank's part of its flattened elements."""

    def __init__(self, t: torch.Tensor, group: Any, offload: bool, arena: CheckpointArena):
        self.shape, self.device, self.requires_grad = t.shape, t.device, t.requires_grad
        self.group, self.numel, self.arena = group, t.numel(), arena
        flat = t.detach().reshape(-1)
        if group is not None:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            self.part = -(-self.numel // world)
            padded = torch.nn.functional.pad(flat, (0, self.part * world - self.numel))
            flat = padded[rank * self.part : (rank + 1) * self.part]
        if offload and flat.is_cuda:
            flat = flat.to("cpu", non_blocking=True)
        self.kept = arena.store(flat)

    def load(self) -> torch.Tensor:
        flat = self.kept.to(self.device, non_blocking=True)
        if self.group is not None:
            world = dist.get_world_size(self.group)
            full = torch.empty(self.part * world, dtype=flat.dtype, device=flat.device)
            _all_gather(full, flat.contiguous(), group=self.group)
            flat = full[: self.numel]
        return flat.detach().view(self.shape).requires_grad_(self.requires_grad)

    def release(self) -> None:
        """The recomputation is done with it: its arena slice may be reused."""
        self.arena.release()


def _rng_snapshot() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, TRACKER.snapshot()


def _rng_restore(snap: tuple[Any, ...]) -> None:
    cpu, cuda, tracker = snap
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    TRACKER.restore(tracker)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], options: dict[str, Any], *args: Any) -> Any:
        ctx.fn, ctx.rng = fn, _rng_snapshot()
        ctx.args = [_Stored(a, options["group"], options["offload"], options["arena"])
                    if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        inputs = [a.load() if isinstance(a, _Stored) else a for a in ctx.args]
        after = _rng_snapshot()
        _rng_restore(ctx.rng)  # the forward's random draws again (dropout masks)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _rng_restore(after)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for a in ctx.args:
            if isinstance(a, _Stored):
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
            (every rank must pass the same inputs: a tensor-parallel group).
        offload: keep CUDA inputs in host memory.
        arena: where inputs are kept (default: one shared arena).
    """
    options = {"group": partition_group, "offload": offload,
               "arena": arena if arena is not None else _DEFAULT_ARENA}
    return _Checkpoint.apply(fn, options, *args)
