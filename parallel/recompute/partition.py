"""ZeRO-R's partitioned activations (P_a): a checkpoint input kept as ``1/N`` per rank.

Inside a tensor-parallel region every TP rank holds the same block input, so keeping it
on each rank wastes ``TP - 1`` copies: each rank keeps ``1/TP`` of its flattened
elements and the whole is all-gathered just before the recomputation. That is right only
if the input *is* the same on every rank of the group. Under sequence parallelism it is
not (each rank holds its own part of the sequence, nothing is duplicated), and the
gathered "whole" would mix the ranks' parts, so that combination is refused:
:func:`refuse_sequence_parallel` when checkpointing is applied to a model, and
:func:`check_identical_inputs` at the first checkpointed forward of each function
(Megatron-LM refuses it too: "distribute_saved_activations must be false when sequence
parallel is enabled").
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .saved_inputs import CheckpointArena

# torch 2.13 renamed the tensor form (the old name warns); older torch has only that.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()  # functions whose inputs were found alike


class Stored:
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


def refuse_sequence_parallel(model: nn.Module, where: str) -> None:
    """Raise if ``model`` has a sequence-parallel layer (its blocks' inputs are then
    split along the sequence, different on each rank: nothing to partition).

    Raises:
        ValueError: naming the first such layer.
    """
    for name, module in model.named_modules():
        if getattr(module, "sequence_parallel", False) is True:
            raise ValueError(
                f"{where}: partition_group (ZeRO-R P_a) keeps 1/N of a block input that "
                f"every rank of the group holds whole, but {name or 'the model'} "
                f"({type(module).__name__}) is sequence parallel: each rank's input is its "
                "own part of the sequence, so the gathered input would mix the ranks. Pass "
                "partition_group=None with sequence parallelism (as Megatron-LM: "
                "distribute_saved_activations must be false when sequence parallel is "
                "enabled)")


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """(numel, sum, position-weighted sum) in float64: alike for identical tensors,
    different for ones that differ, permutations included."""
    flat = torch.nan_to_num(t.detach().reshape(-1).double())
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([torch.tensor(float(flat.numel()), dtype=torch.float64,
                                     device=flat.device), flat.sum(), (flat * weights).sum()])


def check_identical_inputs(fn: Any, args: Sequence[Any], group: Any) -> None:
    """The first time ``fn`` is checkpointed with ``group``: raise, on every rank of the
    group, if its tensor inputs differ across the group's ranks (one all-reduce of three
    numbers per input, once per function: every rank must call this for the same
    functions in the same order, as it does for the forward's collectives).

    Raises:
        ValueError: naming the first input that differs, and why that is wrong.
    """
    key = getattr(fn, "__self__", fn)  # a bound forward: its module
    if key in _CHECKED:
        return
    tensors = [(i, a) for i, a in enumerate(args) if torch.is_tensor(a)]
    if not tensors:
        return
    device = tensors[0][1].device
    prints = torch.stack([_fingerprint(t).to(device) for _, t in tensors])
    extremes = torch.cat([prints, -prints])  # MAX of both: the largest and the smallest
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = extremes[: len(tensors)], -extremes[len(tensors) :]
    differs = (largest != smallest).any(dim=1).tolist()
    if any(differs):
        k = differs.index(True)
        i, t = tensors[k]
        raise ValueError(
            f"checkpoint: partition_group (ZeRO-R P_a) keeps 1/"
            f"{dist.get_world_size(group)} of each input on each rank, which needs the "
            f"input whole and identical on every rank of the group, but input {i} "
            f"(shape {tuple(t.shape)} here) differs across its ranks (its sum runs from "
            f"{float(smallest[k, 1]):.6g} to {float(largest[k, 1]):.6g}): with sequence "
            "parallelism each rank holds its own part of the sequence. Pass "
            "partition_group=None (Megatron-LM: distribute_saved_activations must be "
            "false when sequence parallel is enabled)")
    with contextlib.suppress(TypeError):  # not weak-referenceable: checked every call
        _CHECKED.add(key)
