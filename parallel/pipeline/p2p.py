"""Tensors between neighbouring stages: a small header (dtype, shape), then the data.

The receiver cannot know an activation's shape before the sender ran its stage, so
every message is two: a fixed-size int64 header and the payload. Sends are asynchronous
(the stage goes on computing while they complete); :func:`recv_tensor` blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # dtype code, ndim, sizes


class PendingSend:
    """Sends in flight, and the buffers they read (kept alive until :meth:`wait`)."""

    def __init__(self, works: list[Any], buffers: list[torch.Tensor]):
        self.works, self.buffers = works, buffers

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.buffers = []


def send_tensor(t: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> PendingSend:
    """Start sending ``t`` to group rank ``peer``."""
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise ValueError(f"pipeline: cannot send a {t.dtype} tensor of {t.dim()} dims "
                         f"between stages (dtypes {_DTYPES}, at most {_MAX_DIMS} dims)")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    data = t.detach().contiguous()
    dst = dist.get_global_rank(group, peer) if group is not None else peer
    works = [dist.isend(header, dst, group=group), dist.isend(data, dst, group=group)]
    return PendingSend(works, [header, data])


def recv_tensor(peer: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The next tensor group rank ``peer`` sent us."""
    src = dist.get_global_rank(group, peer) if group is not None else peer
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src, group=group)
    ndim = int(header[1])
    out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=_DTYPES[int(header[0])])
    dist.recv(out, src, group=group)
    return out
