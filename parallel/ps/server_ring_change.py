"""A parameter server's part in a ring change: hold workers' requests, send each row a
new holder lacks (with the pushes still waiting for their step), tell the scheduler once
every copy is acknowledged, then switch to the new ring, drop what this server no longer
holds and take the held requests."""

from __future__ import annotations

from typing import Any

import torch

from .node import send
from .ring import Ring, handover
from .server_state import Pending, ServerState
from .store import Rows, Table, TableSpec


class RingChange:
    """The server's ring-change part (see the module docstring)."""

    ring: Ring | None
    held: list[list[bytes]]
    _preparing: int | None

    def _prepare(self: ServerState, new: Ring, epoch: int) -> None:
        """Hold workers' requests; send each row a new holder lacks, from its first
        surviving old holder; tell the scheduler once every copy is acknowledged."""
        assert self.ring is not None
        self.paused = True
        for name, table in self.tables.items():
            for target, mask in handover(self.ring, new, name, table.keys, self.sid).items():
                self._send_rows(target, table, mask)
        self._maybe_prepared(epoch)

    def _send_rows(self: ServerState, target: int, table: Table, mask: torch.Tensor) -> None:
        rows = table.take(mask)
        names = table.state_names
        entries = []
        tensors = rows.tensors(names)
        for e in self.pending[table.spec.name]:
            moving = torch.isin(e.keys, rows.keys)
            if bool(moving.any()):
                entries.append([e.clock, e.worker])
                tensors += [e.keys[moving], e.grads[moving]]
        mid = self._new_id()
        self.migrations.add(mid)
        send(self._peer(target), {"op": "migrate", "mid": mid, "table": table.spec.as_dict(),
                                  "state": names, "pending": entries,
                                  "vc": self.vc.as_dict()}, tensors)

    def _on_migrate(self: ServerState, who: bytes, header: dict[str, Any],
                    tensors: list[torch.Tensor]) -> None:
        table = self._declare(TableSpec.from_dict(header["table"]))
        names = list(header["state"])
        n = 4 + len(names)
        table.insert(Rows.from_tensors(tensors[:n], names))
        rest = tensors[n:]
        for worker, clock in header.get("vc", {}).items():  # a joining server's clocks
            self.vc.advance(int(worker), int(clock))
        for i, (clock, worker) in enumerate(header["pending"]):
            self.pending[table.spec.name].append(
                Pending(int(clock), int(worker), rest[2 * i], rest[2 * i + 1]))
        self._reply(who, {"op": "migrate_ack", "mid": header["mid"]})

    def _on_migrate_ack(self: ServerState, _: bytes, header: dict[str, Any],
                        __: list[torch.Tensor]) -> None:
        self.migrations.discard(int(header["mid"]))
        self._maybe_prepared(None)

    def _maybe_prepared(self: ServerState, epoch: int | None) -> None:
        if epoch is not None:
            self._preparing = epoch
        if self.paused and not self.migrations and self._preparing is not None:
            send(self.sched, {"op": "prepared", "sid": self.sid, "epoch": self._preparing})
            self._preparing = None

    def _commit(self: ServerState, new: Ring, epoch: int) -> None:
        """Switch to the new ring: drop what this server no longer holds, settle forwards
        to servers that left, and take the held requests."""
        for name, table in self.tables.items():
            if len(table.keys):
                keep = (new.holders(name, table.keys) == self.sid).any(dim=1)
                dropped = table.keys[~keep]
                table.drop(~keep)
                self.pending[name] = [_without(e, dropped) for e in self.pending[name]]
        self.ring, self.epoch, self.paused = new, epoch, False
        self._reforward()
        self._take_held()
        self._step_complete()

    def _take_held(self: ServerState) -> None:
        """Handle the requests held for a ring epoch this server now has."""
        held, self.held = self.held, []
        for frames in held:
            self._from_router(frames)


def _without(entry: Pending, keys: torch.Tensor) -> Pending:
    keep = ~torch.isin(entry.keys, keys)
    return Pending(entry.clock, entry.worker, entry.keys[keep], entry.grads[keep])
