"""How a parameter is split across tensor-parallel ranks, as a value: so a checkpoint
written at one TP size can be rebuilt whole and split again at another, offline.

Every tensor-parallel layer marks its parameters with a :class:`TPSpec` (attribute
``tp_spec``); a parameter without one is whole on every rank (replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPSpec:
    """``dim``: the dimension split across ranks (0: rows, -1: columns), or None when
    every rank holds the whole tensor. ``interleave``: the split dimension is that many
    equal blocks, each split across the ranks (a fused Q, K, V: each rank whole heads)."""

    dim: int | None = None
    interleave: int = 1

    def shard(self, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole tensor ``full``."""
        if self.dim is None or world == 1:
            return full.clone()
        moved = full.movedim(self.dim, 0)
        blocks = moved.reshape(self.interleave, world, -1, *moved.shape[1:])
        return blocks[:, rank].reshape(-1, *moved.shape[1:]).movedim(0, self.dim).contiguous()

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's part, in rank order."""
        if self.dim is None or len(parts) == 1:
            return parts[0].clone()
        moved = [p.movedim(self.dim, 0) for p in parts]
        blocks = torch.stack([m.reshape(self.interleave, -1, *m.shape[1:]) for m in moved], dim=1)
        whole = blocks.reshape(-1, *moved[0].shape[1:])
        return whole.movedim(0, self.dim).contiguous()


REPLICATED = TPSpec()


def spec_of(param: torch.Tensor) -> TPSpec:
    """The parameter's split, replicated when unmarked."""
    return getattr(param, "tp_spec", REPLICATED)


def mark(param: nn.Parameter | None, spec: TPSpec) -> None:
    if param is not None:
        param.tp_spec = spec  # type: ignore[attr-defined]


def mark_tensor_parallel_group(module: nn.Module, group: object) -> None:
    """Record on every parameter of ``module`` the tensor-parallel group it lives in,
    split or not: whoever reduces over the whole model (a global gradient norm) then
    counts a split parameter's parts on every rank and a replicated one once."""
    for p in module.parameters():
        p.tp_group = group  # type: ignore[attr-defined]


def tensor_parallel_group_of(param: torch.Tensor) -> object | None:
    """The group recorded by :func:`mark_tensor_parallel_group`, or None."""
    return getattr(param, "tp_group", None)


def replicated_copies(param: torch.Tensor) -> int:
    """How many tensor-parallel ranks hold this same gradient: the group's size for a
    replicated parameter of a tensor-parallel model, else 1."""
    group = tensor_parallel_group_of(param)
    if group is None or spec_of(param).dim is not None:
        return 1
    return dist.get_world_size(group)  # type: ignore[arg-type]


def model_parallel_groups(params: list[nn.Parameter], override: object = None) -> list[object]:
    """The groups, beyond data parallelism, a sum over the whole model runs over:
    ``override`` if given, else each distinct tensor-parallel group of ``params``."""
    if override is not None:
        return [override]
    seen: dict[int, object] = {}
    for p in params:
        group = tensor_parallel_group_of(p)
        if group is not None:
            seen.setdefault(id(group), group)
    return list(seen.values())
