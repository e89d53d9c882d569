"""A server process: holds the ranges of keys the ring gives it (as primary or replica),
applies pushes with each table's update rule, answers pulls when the consistency model
allows, forwards every update of a range it leads to that range's replicas, and hands
rows over when servers leave or join.

One thread runs the event loop (ZeroMQ ROUTER for workers and peer servers, a DEALER to
the scheduler); heartbeats run on their own thread (pycomm.parallel.ps.node).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from .._optional import missing

try:
    import zmq
except ModuleNotFoundError as err:
    raise missing("zmq", "pycomm.parallel.ps (the parameter server's ZeroMQ transport)",
                  err) from err

from . import snapshot, wire
from .config import JobConfig, address
from .consistency import Gate, VectorClock
from .node import Heartbeat, dealer, send
from .requests import RequestError, checked_request
from .ring import Ring
from .server_replication import ChainReplication
from .server_ring_change import RingChange
from .server_state import Pending
from .store import Table, TableSpec


class Server(ChainReplication, RingChange):
    """One server process (see the module docstring); its replication and ring-change
    parts are :class:`ChainReplication` and :class:`RingChange`."""

    def __init__(self, cfg: JobConfig, bind: str):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 500)
        if bind.endswith(":*") or bind.endswith(":0"):
            port = self.router.bind_to_random_port(address(bind.rsplit(":", 1)[0]))
            self.endpoint = f"{address(bind.rsplit(':', 1)[0])}:{port}"
        else:
            self.router.bind(address(bind))
            self.endpoint = address(bind)
        self.sched = dealer(self.ctx, cfg.scheduler, f"server-pid{os.getpid()}")
        self.sid = -1
        self.tables: dict[str, Table] = {}
        self.pending: dict[str, list[Pending]] = {}
        self.vc = VectorClock(cfg.workers)
        self.gate = Gate(cfg.consistency, cfg.tau)
        self.ring: Ring | None = None
        self.epoch = -1
        self.endpoints: dict[int, str] = {}
        self.peers: dict[int, zmq.Socket] = {}
        self.deferred: list[tuple[bytes, dict[str, Any], list[torch.Tensor]]] = []
        self.held: list[list[bytes]] = []
        self.forwards: dict[int, dict[str, Any]] = {}
        self.migrations: set[int] = set()
        self.next_id = 0
        self.paused = False
        self._preparing: int | None = None
        self.checkpoint_due: tuple[str, int] | None = None
        self.running = True
        self.heartbeat: Heartbeat | None = None

    # -- life --------------------------------------------------------------------------------

    def run(self) -> None:
        send(self.sched, {"op": "register", "role": "server", "endpoint": self.endpoint,
                          "pid": os.getpid()})
        try:
            while self.running:
                poller = zmq.Poller()
                for sock in [self.router, self.sched, *self.peers.values()]:
                    poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(100))
                if self.sched in events:
                    self._from_scheduler(self.sched.recv_multipart())
                for sock in events:
                    if sock is self.sched:
                        continue
                    for _ in range(64):  # a batch, then the scheduler gets a look again
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if sock is not self.router:  # a peer's answer on our DEALER
                            frames = [b"s", *frames]
                        self._from_router(frames)
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            for sock in [self.router, self.sched, *self.peers.values()]:
                sock.close(linger=200)
            self.ctx.term()

    def _peer(self, sid: int) -> zmq.Socket:
        if sid not in self.peers:
            self.peers[sid] = dealer(self.ctx, self.endpoints[sid], f"s{self.sid}")
        return self.peers[sid]

    # -- the scheduler ---------------------------------------------------------------------

    def _from_scheduler(self, frames: list[bytes]) -> None:
        header, _ = wire.unpack(frames)
        op = header["op"]
        if op == "start":
            self.sid = int(header["sid"])
            self.heartbeat = Heartbeat(self.ctx, self.cfg.scheduler, f"server{self.sid}")
            self._set_members(header)
            self.ring, self.epoch = Ring.from_spec(header["ring"]), int(header["epoch"])
            if header.get("restore"):
                self._restore(list(header["files"]), int(header["clock"]))
            # A worker may have had its own start first and asked before ours came (two
            # connections, no order between them): what it sent was held, for this epoch.
            self._take_held()
        elif op == "prepare":
            self._set_members(header)
            self._prepare(Ring.from_spec(header["ring"]), int(header["epoch"]))
        elif op == "commit":
            self._commit(Ring.from_spec(header["ring"]), int(header["epoch"]))
        elif op == "worker_lost":
            self._forget_unfinished_step(int(header["worker"]))
        elif op == "workers":
            self.vc.live = {int(w) for w in header["live"]}
            self._step_complete()
        elif op == "checkpoint":
            # Written once every worker's clock has reached the caller's (their clock
            # messages may still be on their way), so the steps before it are applied.
            self.checkpoint_due = (str(header["path"]), int(header.get("clock", 0)))
            self._step_complete()
        elif op == "stats":
            send(self.sched, {"op": "stats", "sid": self.sid, **self._stats()})
        elif op == "stop":
            self.running = False

    def _set_members(self, header: dict[str, Any]) -> None:
        self.endpoints = {int(k): v for k, v in header["endpoints"].items()}
        for sid in [s for s in self.peers if s not in self.endpoints]:
            self.peers.pop(sid).close(linger=0)

    # -- requests ----------------------------------------------------------------------------

    def _from_router(self, frames: list[bytes]) -> None:
        who, body = frames[0], frames[1:]
        try:
            header, tensors = wire.unpack(body)
        except wire.WireError as e:
            self._reply(who, {"op": "error", "message": f"server {self.sid}: from "
                              f"{who.decode(errors='replace')}: {e}"})
            return
        peer = who.startswith(b"s")
        if not peer and (self.paused or int(header.get("epoch", self.epoch)) > self.epoch):
            self.held.append(frames)  # a ring change is under way, or we are behind it
            return
        try:
            self._handle(who, header, tensors, peer)
        except (RequestError, KeyError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            self._reply(who, {"op": "error", "id": header.get("id"), "message":
                              f"server {self.sid}: {header.get('op')} from "
                              f"{who.decode(errors='replace')}: {msg}"})

    def _handle(self, who: bytes, header: dict[str, Any], tensors: list[torch.Tensor],
                peer: bool) -> None:
        op = header["op"]
        if peer:
            {"fwd": self._on_forward, "fwd_ack": self._on_forward_ack,
             "migrate": self._on_migrate, "migrate_ack": self._on_migrate_ack,
             }[op](who, header, tensors)
            return
        if op not in ("declare", "clock", "stats") and int(header.get("epoch", -1)) < self.epoch:
            self._reply(who, {"op": "stale", "id": header.get("id"), "epoch": self.epoch})
            return
        handler = {"declare": self._on_declare, "push": self._on_update, "set": self._on_update,
                   "pull": self._on_pull, "clock": self._on_clock, "stats": self._on_stats}
        if op not in handler:
            raise RequestError(f"unknown op {op!r}")
        handler[op](who, header, tensors)

    def _reply(self, who: bytes, header: dict[str, Any], tensors: list[torch.Tensor] | tuple = ()
               ) -> None:
        send(self.router, header, tensors, to=who)

    def _on_declare(self, who: bytes, header: dict[str, Any], _: list[torch.Tensor]) -> None:
        spec = TableSpec.from_dict(header["table"])
        self._declare(spec)
        self._reply(who, {"op": "ok", "id": header.get("id")})

    def _declare(self, spec: TableSpec) -> Table:
        if spec.name in self.tables:
            have = self.tables[spec.name].spec
            if have != spec:
                raise RequestError(f"table {spec.name!r} was declared as {have.as_dict()}, "
                                   f"now as {spec.as_dict()}")
            return self.tables[spec.name]
        self.tables[spec.name] = Table(spec, self.cfg.workers)
        self.pending[spec.name] = []
        return self.tables[spec.name]

    def _checked(self, header: dict[str, Any], tensors: list[torch.Tensor],
                 values: bool) -> tuple[Table, torch.Tensor, torch.Tensor | None]:
        return checked_request(self.tables, header, tensors, values)

    def _check_holder(self, table: Table, keys: torch.Tensor, primary: bool) -> None:
        assert self.ring is not None
        holders = self.ring.holders(table.spec.name, keys)
        mine = holders[:, 0] == self.sid if primary else (holders == self.sid).any(dim=1)
        if not bool(mine.all()):
            raise RequestError(f"table {table.spec.name!r}: {int((~mine).sum())} key(s) "
                               f"are not held here under ring epoch {self.epoch}")

    def _on_update(self, who: bytes, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        table, keys, vals = self._checked(header, tensors, values=True)
        assert vals is not None
        self._check_holder(table, keys, primary=True)
        self._apply(table, header, keys, vals)
        self._forward(who, table, header, keys, vals)

    def _apply(self, table: Table, header: dict[str, Any], keys: torch.Tensor,
               vals: torch.Tensor) -> None:
        worker, seq = int(header["worker"]), int(header["seq"])
        if not 0 <= worker < self.cfg.workers:
            raise RequestError(f"worker {worker} is not in [0, {self.cfg.workers})")
        rows = table.rows_for(keys, create=header["op"] == "set" or table.spec.init == "zeros")
        fresh = table.fresh_rows(rows, worker, seq)
        rows, keys, vals = rows[fresh], keys[fresh], vals[fresh]
        if header["op"] == "set":
            table.values[rows] = vals
            table.seen[rows, worker] = seq
            return
        table.record(rows, worker, seq)
        if self.gate.aggregates:
            self.pending[table.spec.name].append(Pending(int(header["clock"]), worker, keys, vals))
        else:
            table.update(rows, vals)

    # -- pulls and clocks --------------------------------------------------------------------

    def _on_pull(self, who: bytes, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        table, keys, _ = self._checked(header, tensors, values=False)
        self._check_holder(table, keys, primary=True)
        if not self.gate.may_answer(int(header.get("clock", 0)), self.vc):
            self.deferred.append((who, header, tensors))
            return
        rows = table.rows_for(keys, create=table.spec.init == "zeros")
        self._reply(who, {"op": "values", "id": header.get("id")}, [table.values[rows]])

    def _on_clock(self, _: bytes, header: dict[str, Any], __: list[torch.Tensor]) -> None:
        self.vc.advance(int(header["worker"]), int(header["clock"]))
        self._step_complete()

    def _step_complete(self) -> None:
        """Apply the BSP steps every live worker finished, then answer the pulls that may
        now be answered."""
        floor = self.vc.floor()
        for name, entries in self.pending.items():
            done = [e for e in entries if e.clock < floor]
            if not done:
                continue
            self.pending[name] = [e for e in entries if e.clock >= floor]
            for clock in sorted({e.clock for e in done}):
                self._apply_step(self.tables[name], [e for e in done if e.clock == clock])
        waiting, self.deferred = self.deferred, []
        for who, header, tensors in waiting:
            self._handle(who, header, tensors, peer=False)
        if self.checkpoint_due is not None and floor >= self.checkpoint_due[1]:
            self._checkpoint(self.checkpoint_due[0])
            self.checkpoint_due = None

    def _forget_unfinished_step(self, worker: int) -> None:
        """A dead worker's replacement redoes the step it died in: its pushes of that
        step (still pending under BSP: the step was not complete) are dropped, and its
        push numbers start again."""
        finished = self.vc.finished[worker]
        for name, entries in self.pending.items():
            self.pending[name] = [e for e in entries
                                  if not (e.worker == worker and e.clock >= finished)]
        for table in self.tables.values():
            table.seen[:, worker] = -1

    def _apply_step(self, table: Table, entries: list[Pending]) -> None:
        """One update from a step's pushes, summed in worker order (the same sum on every
        replica, whatever order the pushes arrived in)."""
        entries.sort(key=lambda e: e.worker)
        keys = torch.cat([e.keys for e in entries])
        unique, inverse = torch.unique(keys, return_inverse=True)
        total = torch.zeros(len(unique), table.spec.dim)
        total.index_add_(0, inverse, torch.cat([e.grads for e in entries]))
        table.update(table.rows_for(unique, create=True), total)

    def _stats(self) -> dict[str, Any]:
        """Pushes applied to the keys this server leads (each key counted once in the job)."""
        applied = 0
        if self.ring is not None:
            for name, t in self.tables.items():
                if len(t.keys):
                    lead = self.ring.primary(name, t.keys) == self.sid
                    applied += int(t.applied[lead].sum())
        return {"applied": applied, "vc": self.vc.as_dict(), "epoch": self.epoch}

    def _on_stats(self, who: bytes, header: dict[str, Any], _: list[torch.Tensor]) -> None:
        self._reply(who, {"op": "stats", "id": header.get("id"), **self._stats()})

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint(self, path: str) -> None:
        assert self.ring is not None
        snapshot.write(path, self.sid, self.tables, self.ring)
        send(self.sched, {"op": "checkpointed", "sid": self.sid})

    def _restore(self, files: list[str], clock: int) -> None:
        """The rows this server holds under its ring (which may differ from the saving
        job's), and the workers' clock."""
        assert self.ring is not None
        for spec, rows in snapshot.held_rows(files, self.ring, self.sid):
            self._declare(spec).insert(rows)
        for worker in self.vc.finished:
            self.vc.advance(worker, clock)


def main() -> None:
    torch.set_num_threads(1)
    cfg = JobConfig.from_env()
    bind = os.environ.get("PS_BIND", "tcp://127.0.0.1:*")
    try:
        Server(cfg, bind).run()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
