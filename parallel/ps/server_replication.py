"""Chain replication of a parameter server's updates: each update of a range this server
leads goes down the chains of that range's replicas (the next R servers on the ring),
and the worker is answered once every chain's tail has acknowledged, so an acknowledged
push survives R servers. After a ring change the unacknowledged ones are sent down the
new chains."""

from __future__ import annotations

from typing import Any

import torch

from .node import send
from .server_state import ServerState
from .store import Table


class ChainReplication:
    """The server's replication part (see the module docstring)."""

    def _forward(self: ServerState, who: bytes, table: Table, header: dict[str, Any],
                 keys: torch.Tensor, vals: torch.Tensor) -> None:
        """Chain replication: send the update down each chain of replicas its keys have
        (the next R servers on the ring); the chain's tail acknowledges to this server,
        which answers the worker once every chain has (so an acknowledged push survives
        R servers)."""
        reply = {"op": "ok", "id": header.get("id")}
        fields: dict[str, Any] = {k: header[k] for k in ("table", "worker", "seq", "clock")
                                  if k in header}
        entry = {"to": who, "reply": reply, "parts": {}, "kind": header["op"],
                 "fields": fields}
        fid = self._new_id()
        self.forwards[fid] = entry
        self._send_chains(fid, keys, vals)
        if not entry["parts"]:
            del self.forwards[fid]
            self._reply(who, reply)

    def _send_chains(self: ServerState, fid: int, keys: torch.Tensor, vals: torch.Tensor) -> None:
        """Send ``keys`` down their chains under the current ring (every holder but this
        server, in ring order); each chain is a part awaiting its tail's ack."""
        assert self.ring is not None
        entry = self.forwards[fid]
        holders = self.ring.holders(entry["fields"]["table"], keys)
        if holders.shape[1] < 2:
            return
        chains, which = torch.unique(holders, dim=0, return_inverse=True)
        for i, chain in enumerate(chains.tolist()):
            rest = [s for s in chain if s != self.sid]
            if not rest:
                continue
            mask = which == i
            part = self._new_id()
            entry["parts"][part] = (keys[mask], vals[mask])
            send(self._peer(rest[0]), {"op": "fwd", "kind": entry["kind"], "fid": fid,
                                       "part": part, "origin": self.sid, "chain": rest[1:],
                                       **entry["fields"]}, [keys[mask], vals[mask]])

    def _on_forward(self: ServerState, who: bytes, header: dict[str, Any],
                    tensors: list[torch.Tensor]) -> None:
        """Apply, then pass the update down the chain; the tail acknowledges to the
        chain's head."""
        table, keys, vals = self._checked(header, tensors, values=True)
        assert vals is not None
        self._apply(table, {**header, "op": header["kind"]}, keys, vals)
        chain = [int(s) for s in header.get("chain", [])]
        if chain and chain[0] in self.endpoints:
            send(self._peer(chain[0]), {**header, "chain": chain[1:]},
                 [keys, vals])
        else:
            send(self._peer(int(header["origin"])), {"op": "fwd_ack", "fid": header["fid"],
                                                     "part": header["part"]})

    def _on_forward_ack(self: ServerState, _: bytes, header: dict[str, Any],
                        __: list[torch.Tensor]) -> None:
        self._forward_done(int(header["fid"]), int(header["part"]))

    def _forward_done(self: ServerState, fid: int, part: int) -> None:
        entry = self.forwards.get(fid)
        if entry is None:
            return
        entry["parts"].pop(part, None)
        if not entry["parts"]:
            del self.forwards[fid]
            self._reply(entry["to"], entry["reply"])

    def _reforward(self: ServerState) -> None:
        """After a ring change, the updates whose chains have not all acknowledged are
        sent down the new chains (a server that already applied one skips it: it
        remembers each worker's last push per key)."""
        for fid in list(self.forwards):
            entry = self.forwards[fid]
            parts, entry["parts"] = entry["parts"], {}
            for keys, vals in parts.values():
                self._send_chains(fid, keys, vals)
            if not entry["parts"]:
                del self.forwards[fid]
                self._reply(entry["to"], entry["reply"])

    def _new_id(self: ServerState) -> int:
        self.next_id += 1
        return self.next_id
