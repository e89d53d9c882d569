"""Parameter groups for :class:`ZeroOptimizer`: which group each parameter is in, and
this rank's shards cut into per-group *pieces*, the tensors the inner optimizer steps.

A bucket (stage 3: a unit) packs parameters of any groups side by side, so a rank's
shard of it can hold elements of several groups. The shard is cut where the group
changes; each maximal run of one group's elements is one piece, and the inner
optimizer gets one param group per :class:`ZeroOptimizer` group holding that group's
pieces, with that group's options. The shard's padding joins the piece before it (it
has zero gradients, and stays zero under every elementwise optimizer). With a single
group each shard is exactly one piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .shard_layout import ShardLayout

# Keys of a group that are not hyper-parameters (torch adds "param_names" for named params).
NOT_OPTIONS = ("params", "param_names")


def normalize_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """``params`` as torch accepts it (tensors, ``(name, tensor)`` pairs, or dicts of
    them) as a list of new group dicts, parameters that do not require grad left out.

    Raises:
        TypeError: a group without ``"params"``, or a set of parameters (unordered).
        ValueError: no parameters at all.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("ZeroOptimizer: params must be an iterable of tensors or dicts, "
                        "got one tensor")
    given = list(params)
    if not given:
        raise ValueError("ZeroOptimizer: got an empty parameter list")
    groups = given if isinstance(given[0], dict) else [{"params": given}]
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"ZeroOptimizer: parameter group {g} must be a dict with 'params'")
        members = group["params"]
        if isinstance(members, set):
            raise TypeError(f"ZeroOptimizer: parameter group {g} is a set; pass a list "
                            "(the order decides the layout)")
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        kept = [m for m in members if _tensor(m).requires_grad]
        out.append({**group, "params": kept})
    return out


def _tensor(member: Any) -> torch.Tensor:
    return member[1] if isinstance(member, tuple) else member


def group_tensors(group: dict[str, Any]) -> list[torch.Tensor]:
    """The group's parameters as tensors (names of ``(name, tensor)`` pairs dropped)."""
    return [_tensor(m) for m in group["params"]]


def options(group: dict[str, Any]) -> dict[str, Any]:
    """The group's hyper-parameters (everything but its parameters and their names)."""
    return {k: v for k, v in group.items() if k not in NOT_OPTIONS}


def check_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Raises ValueError for a parameter passed twice (in one group or two) or parameters
    of several dtypes; returns ``params``."""
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(f"ZeroOptimizer: parameter {i} is the same tensor as parameter "
                             f"{seen[id(p)]}; pass each parameter once (in one group)")
        seen[id(p)] = i
    if len({p.dtype for p in params}) > 1:
        dtypes = sorted({str(p.dtype) for p in params})
        raise ValueError(f"ZeroOptimizer: parameters must share one dtype, got {dtypes}")
    return params


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of this rank's shard of bucket ``bucket``, all of group
    ``group`` (plus, for the bucket's last piece, the shard's padding)."""

    bucket: int
    start: int
    stop: int
    group: int


def plan_pieces(layout: ShardLayout, group_of: Sequence[int]) -> list[Piece]:
    """This rank's shards cut at every change of group, bucket by bucket."""
    pieces: list[Piece] = []
    for k, bucket in enumerate(layout.buckets):
        mine = bucket.shard_of(layout.rank)
        runs: list[list[int]] = []  # [start, stop, group] in shard coordinates
        for i in sorted(bucket.params, key=lambda i: layout.offsets[i]):
            lo = max(layout.offsets[i], mine.start) - mine.start
            hi = min(layout.offsets[i] + layout.numels[i], mine.stop) - mine.start
            if lo >= hi:
                continue
            if runs and runs[-1][2] == group_of[i] and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, group_of[i]])
        if not runs:  # a shard of padding only: it goes with the bucket's last parameter
            runs.append([0, 0, group_of[bucket.params[-1]]])
        runs[0][0], runs[-1][1] = 0, bucket.shard  # padding joins the last piece
        pieces += [Piece(k, start, stop, g) for start, stop, g in runs]
    return pieces
