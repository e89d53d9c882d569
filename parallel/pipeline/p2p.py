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


class Receiver:
    """Receives from one neighbour in a known order, posting the next receive ahead of
    time once that message's shape is known (from the same point of an earlier step), so
    it arrives while the stage computes. Keys name a message, e.g. (input signature,
    micro-batch); a key seen before is expected to carry the same shape again.
    """

    def __init__(self, peer: int, group: dist.ProcessGroup | None):
        self.peer, self.group = peer, group
        self.src = dist.get_global_rank(group, peer) if group is not None else peer
        self.shapes: dict[Any, tuple[list[int], torch.dtype]] = {}
        self._posted: tuple[Any, torch.Tensor, torch.Tensor, list[Any]] | None = None
        self.posted_ahead = 0  # messages whose receive was posted before it was needed
        self.received_now = 0  # messages received only when needed (shape not yet known)

    def prepost(self, key: Any) -> None:
        """Start receiving message ``key`` now, if its shape is known and nothing is posted."""
        if self._posted is not None or key not in self.shapes:
            return
        shape, dtype = self.shapes[key]
        header = torch.empty(_HEADER, dtype=torch.int64)
        data = torch.empty(shape, dtype=dtype)
        works = [dist.irecv(header, self.src, group=self.group),
                 dist.irecv(data, self.src, group=self.group)]
        self._posted = (key, header, data, works)

    def take(self, key: Any) -> torch.Tensor:
        """Message ``key``: the posted one, or received now.

        Raises:
            RuntimeError: if a posted message arrives with another shape than before.
        """
        if self._posted is None:
            out = recv_tensor(self.peer, self.group)
            self.received_now += 1
        else:
            self.posted_ahead += 1
            posted_key, header, out, works = self._posted
            self._posted = None
            if posted_key != key:
                raise RuntimeError(f"pipeline: posted a receive for {posted_key}, asked for {key}")
            for work in works:
                work.wait()
            ndim = int(header[1])
            if header[2 : 2 + ndim].tolist() != list(out.shape):
                raise RuntimeError(
                    f"pipeline: message {key} from stage rank {self.peer} has shape "
                    f"{header[2 : 2 + ndim].tolist()}, it had {list(out.shape)} before with "
                    "the same inputs; stage outputs must have one shape per input shape")
        self.shapes[key] = (list(out.shape), out.dtype)
        return out
