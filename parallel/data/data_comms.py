"""The collectives data parallelism needs besides the gradient buckets."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

Group = dist.ProcessGroup | None


def src_rank(group: Group) -> int:
    """Global rank of the group's rank 0 (what ``dist.broadcast(src=...)`` takes)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def averaging_op(group: Group) -> tuple[dist.ReduceOp.RedOpType, bool]:
    """(op, divide_after): AVG where the backend fuses it into the collective, else SUM
    and a division afterwards (gloo has no AVG)."""
    if str(dist.get_backend(group)) in ("pycomm", "nccl"):
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


def verify_same_params(names: Sequence[str], params: Sequence[nn.Parameter], group: Group) -> None:
    """Every rank wraps the same parameter shapes (else buckets would not line up).

    Raises:
        ValueError: naming the first rank whose parameters differ from rank 0's.
    """
    numel = sum(p.numel() for p in params)
    # crc32, not hash(): str hashes differ between processes.
    described = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params, strict=True)]
    signature = zlib.crc32(repr(described).encode())
    mine = torch.tensor([len(params), numel, signature], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        if not torch.equal(theirs, gathered[0]):
            raise ValueError(
                f"DataParallel: group rank {rank} has {int(theirs[0])} parameters with "
                f"{int(theirs[1])} elements, rank 0 has {int(gathered[0][0])} with "
                f"{int(gathered[0][1])} (or their names/shapes/dtypes differ): every rank "
                "must wrap the same model"
            )


def broadcast_through(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Broadcast ``tensors`` from the group's rank 0 as one collective, staged in
    ``buffer`` (which must hold them all; the gradient arena is used, then re-zeroed)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    total = sum(t.numel() for t in flat)
    stage = buffer[:total]
    if flat:
        torch.cat(flat, out=stage)
    dist.broadcast(stage, src=src_rank(group), group=group)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(stage[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    buffer.zero_()


def broadcast_order(order: list[int], group: Group) -> list[int]:
    """Rank 0's list of indices, on every rank (the bucket order must agree)."""
    t = torch.tensor(order, dtype=torch.int64)
    dist.broadcast(t, src=src_rank(group), group=group)
    return t.tolist()


def globally_unused(touched: Sequence[bool], group: Group) -> list[int]:
    """Indices no rank produced a gradient for since gradients were last reset."""
    flags = torch.tensor(touched, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [i for i, used in enumerate(flags.tolist()) if not used]


def broadcast_buffers(module: nn.Module, group: Group) -> None:
    """Rank 0's module buffers (e.g. batch-norm statistics) on every rank, as DDP does."""
    for b in module.buffers():
        dist.broadcast(b.data, src=src_rank(group), group=group)
