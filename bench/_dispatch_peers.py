"""The ways to move expert parallelism's tokens that bench.dispatch times side by side.

Each peer takes a rank's rows (ordered by expert) and their counts per (rank, local
expert), and does what a mixture-of-experts layer needs: **dispatch** (every row to the
rank holding its expert, the receiver learning how many rows of each expert it gets) and
**combine** (the computed rows back, in the order they were sent).

- ``pycomm``: ``pycomm.dispatch`` (the counts ride inside the op) and ``pycomm.combine``;
  ``pycomm#2`` is the same on a second group (the A/A column).
- ``pycomm-a2a``, ``gloo``: what torchtitan and Megatron's all-to-all dispatcher do over
  ``torch.distributed``: one ``all_to_all_single`` of the counts, their splits read on
  the host, one of the rows; the way back with the splits known.
- ``mpi``: the same with Open MPI through mpi4py (``Alltoall`` of the counts, then
  ``Alltoallv``), on numpy views of the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import pycomm
from bench import _mpi


class CountedPeer:
    """pycomm's dispatch and combine."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="pycomm")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[Any, Any]:
        return pycomm.dispatch(rows, counts, self.group)

    def combine(self, rows: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
                ) -> torch.Tensor:
        return pycomm.combine(rows, sent, received, self.group)


class TorchPeer:
    """Counts first, then rows, over a torch.distributed group of ``backend``."""

    def __init__(self, backend: str) -> None:
        self.group = dist.new_group(backend=backend)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[Any, Any]:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return self._move(rows, counts, received), received

    def combine(self, rows: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
                ) -> torch.Tensor:
        return self._move(rows, received, sent)

    def _move(self, rows: torch.Tensor, have: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        send, recv = have.sum(1).tolist(), want.sum(1).tolist()
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return out


class MpiPeer:
    """Counts by MPI_Alltoall, rows by MPI_Alltoallv."""

    def __init__(self) -> None:
        self.comm = _mpi.MpiComm().comm

    def barrier(self) -> None:
        self.comm.Barrier()

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[Any, Any]:
        received = torch.empty_like(counts)
        self.comm.Alltoall(counts.numpy(), received.numpy())
        return self._move(rows, counts, received), received

    def combine(self, rows: torch.Tensor, sent: torch.Tensor, received: torch.Tensor
                ) -> torch.Tensor:
        return self._move(rows, received, sent)

    def _move(self, rows: torch.Tensor, have: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        per_row = rows[0].numel() if rows.dim() > 1 else 1
        send = (have.sum(1) * per_row).tolist()
        recv = (want.sum(1) * per_row).tolist()
        out = rows.new_empty((sum(recv) // per_row, *rows.shape[1:]))
        offsets = [sum(send[:i]) for i in range(len(send))]
        roffsets = [sum(recv[:i]) for i in range(len(recv))]
        src, dst = _mpi._as_numpy(rows.reshape(-1)), _mpi._as_numpy(out.reshape(-1))
        self.comm.Alltoallv([src, (send, offsets)], [dst, (recv, roffsets)])
        return out


def make(name: str) -> Any:
    """The peer of a column name (``pycomm#2``: another pycomm group, the A/A column)."""
    base = name.split("#")[0]
    if base == "pycomm":
        return CountedPeer()
    if base == "pycomm-a2a":
        return TorchPeer("pycomm")
    if base == "mpi":
        return MpiPeer()
    return TorchPeer(base)


def missing(name: str) -> str:
    """Why the peer cannot run in this job, or ''."""
    if name.split("#")[0] == "mpi":
        if _mpi.world_from_env() is None:
            return "not started by mpirun"
        return _mpi.missing()
    return ""
