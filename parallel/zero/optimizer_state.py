"""What a ``ZeroOptimizer.state_dict()`` is valid for, and the check on loading it.

The dict holds the inner optimizer's own ``state_dict`` (state of this rank's pieces,
keyed by piece index, and the inner groups), the fp32 master shards when they are not
the model's parameters (stages 1-2 under mixed precision) and every group's options,
beside a *signature*: stage, world size, rank, precisions, the inner optimizer's class,
the layout (parameter sizes, buckets, pieces) and the grouping. Loading compares the
signature key by key and names the first that differs; resharding onto another world
size is :mod:`pycomm.parallel.zero.sharded_checkpoint`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .param_groups import Piece
from .precision import Precision
from .shard_layout import ShardLayout

FORMAT = "pycomm.zero.optimizer/1"
KEYS = ("world", "rank", "stage", "precision", "optimizer", "layout", "groups")
_HINT = ("; to change world size or stage, save with pycomm.parallel.zero.save_sharded and load "
         "with load_sharded")


def signature(stage: int, world: int, rank: int, precision: Precision,
              optimizer: torch.optim.Optimizer, layout: ShardLayout, pieces: Sequence[Piece],
              group_params: Sequence[Sequence[int]]) -> dict[str, Any]:
    """What the state of one rank is valid for (plain values: it is saved with it)."""
    return {
        "format": FORMAT,
        "stage": stage,
        "world": world,
        "rank": rank,
        "precision": [str(d) for d in (precision.master, precision.compute, precision.reduce)],
        "optimizer": type(optimizer).__name__,
        "layout": {"numels": list(layout.numels),
                   "buckets": [(tuple(b.params), b.start, b.shard) for b in layout.buckets],
                   "pieces": [(p.bucket, p.start, p.stop, p.group) for p in pieces]},
        "groups": [list(g) for g in group_params],
    }


def check(mine: dict[str, Any], state: Any) -> None:
    """Raises ValueError naming the first way ``state`` does not fit ``mine`` (a
    :func:`signature`)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"ZeroOptimizer.load_state_dict: not a ZeroOptimizer state_dict "
                         f"(format {got!r}, expected {FORMAT!r})")
    for key in KEYS:
        saved, now = state.get(key), mine[key]
        if saved == now:
            continue
        what = key
        if key == "layout":  # too long to print whole: say which part differs
            part = next(k for k in now if (saved or {}).get(k) != now[k])
            saved, now, what = (saved or {}).get(part), now[part], f"layout ({part})"
        raise ValueError(f"ZeroOptimizer.load_state_dict: the state was saved with {what} "
                         f"{_short(saved)}, this optimizer has {_short(now)}"
                         + (_HINT if key in ("world", "stage") else ""))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
