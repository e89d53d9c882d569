"""The collectives of ZeRO stages 1 and 2, one bucket at a time."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..data.data_comms import averaging_op, src_rank

Group = dist.ProcessGroup | None
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

__all__ = ["all_gather_shard", "averaging_op", "broadcast_flat", "gather_unit",
           "reduce_scatter_bucket"]


def broadcast_flat(flat: torch.Tensor, group: Group) -> None:
    """Rank 0's parameters everywhere, in one collective on the flat buffer."""
    dist.broadcast(flat, src=src_rank(group), group=group)


def reduce_scatter_bucket(out: torch.Tensor, bucket: torch.Tensor, op: Any, group: Group) -> Any:
    """Each rank receives the reduced ``1/world`` of ``bucket`` that it owns (async)."""
    return _reduce_scatter(out, bucket, op=op, group=group, async_op=True)


def all_gather_shard(full: torch.Tensor, rank: int, group: Group) -> Any:
    """Rebuild ``full`` from every rank's shard, ours already in place in it (async)."""
    shard = full.numel() // dist.get_world_size(group)
    mine = full[rank * shard : (rank + 1) * shard]
    return _all_gather(full, mine, group=group, async_op=True)


def gather_unit(full: torch.Tensor, shard: torch.Tensor, group: Group) -> Any:
    """Stage 3: ``full`` becomes every rank's ``shard`` side by side (async)."""
    return _all_gather(full, shard, group=group, async_op=True)
