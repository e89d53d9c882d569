"""What a parameter server's parts share: its state and the steps they call on each
other (:class:`ServerState`, the protocol the parts' methods take as ``self``), and a
push waiting for its step (:class:`Pending`).

The server (``server.py``: the event loop, requests, pulls and clocks, checkpoints) is
built from parts of one concept each: chain replication of updates
(``server_replication.py``) and the hand-over of rows when the ring changes
(``server_ring_change.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .consistency import VectorClock
from .ring import Ring
from .store import Table, TableSpec


@dataclass
class Pending:
    """A BSP push waiting for its step to complete (applied summed with the others)."""

    clock: int
    worker: int
    keys: torch.Tensor
    grads: torch.Tensor


class ServerState(Protocol):
    sid: int
    epoch: int
    ring: Ring | None
    tables: dict[str, Table]
    pending: dict[str, list[Pending]]
    vc: VectorClock
    endpoints: dict[int, str]
    forwards: dict[int, dict[str, Any]]
    migrations: set[int]
    held: list[list[bytes]]
    next_id: int
    paused: bool
    _preparing: int | None
    sched: Any

    def _peer(self, sid: int) -> Any: ...

    def _reply(self, who: bytes, header: dict[str, Any],
               tensors: list[torch.Tensor] | tuple = ()) -> None: ...

    def _checked(self, header: dict[str, Any], tensors: list[torch.Tensor],
                 values: bool) -> tuple[Table, torch.Tensor, torch.Tensor | None]: ...

    def _apply(self, table: Table, header: dict[str, Any], keys: torch.Tensor,
               vals: torch.Tensor) -> None: ...

    def _declare(self, spec: TableSpec) -> Table: ...

    def _from_router(self, frames: list[bytes]) -> None: ...

    def _step_complete(self) -> None: ...

    def _new_id(self) -> int: ...

    def _send_chains(self, fid: int, keys: torch.Tensor, vals: torch.Tensor) -> None: ...

    def _forward_done(self, fid: int, part: int) -> None: ...

    def _reforward(self) -> None: ...

    def _send_rows(self, target: int, table: Table, mask: torch.Tensor) -> None: ...

    def _maybe_prepared(self, epoch: int | None) -> None: ...

    def _take_held(self) -> None: ...
