"""The scheduler: registers servers and workers, gives servers their ids and the ring,
watches heartbeats, and changes the ring when a server dies or joins (prepare: the
servers copy the rows new holders lack; commit: everyone switches). It also runs
barriers, checkpoints, and ends the job when every live worker is done.

Workers and servers talk to it over one ROUTER; a node is known by the name it
registered under (``server{i}``, ``worker{r}``); heartbeats come on a socket of their
own (``...-hb``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._optional import missing

try:
    import zmq
except ModuleNotFoundError as err:
    raise missing("zmq", "pycomm.parallel.ps (the parameter server's ZeroMQ transport)",
                  err) from err

from . import wire
from .config import JobConfig, address
from .node import send
from .ring import Ring


@dataclass
class Node:
    name: str
    identity: bytes
    endpoint: str = ""
    pid: int = 0
    last_seen: float = field(default_factory=time.monotonic)


CHECKPOINT_FORMAT = "pycomm.ps/1"
POLL_S = 0.1  # the loop's wait for a message
# A node is dead when silent longer than the heartbeat timeout, or than MISSES times the
# longest gap yet seen between any node's heartbeats, whichever is longer: on a loaded
# machine (more processes than cores) heartbeats come late, and the deadline follows.
MISSES = 4
DRAIN = 1000  # messages read per loop at most, before liveness is judged


def read_job_checkpoint(path: str, cfg: JobConfig) -> dict[str, Any]:
    """What a restart needs from a checkpoint folder, checked: its server files and the
    clock the workers go on from."""
    job_file = os.path.join(path, "job.pt")
    if not os.path.exists(job_file):
        raise FileNotFoundError(f"ps restore: {path} has no job.pt: not a complete "
                                "parameter-server checkpoint")
    job = torch.load(job_file, weights_only=True)
    if job.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"ps restore: {job_file} is format {job.get('format')!r}, not "
                         f"{CHECKPOINT_FORMAT!r}")
    if int(job["workers"]) != cfg.workers:
        raise ValueError(f"ps restore: the checkpoint has {job['workers']} workers' clocks, "
                         f"this job {cfg.workers} workers")
    files = [os.path.join(path, f"server{s}.pt") for s in job["servers"]]
    if missing := [f for f in files if not os.path.exists(f)]:
        raise FileNotFoundError(f"ps restore: missing {missing}")
    return {"path": path, "files": files, "clock": int(job["clock"])}


class Scheduler:
    def __init__(self, cfg: JobConfig, log: Callable[[str], None] | None = None,
                 restore: str = "",
                 spawn_server: Callable[[], None] | None = None,
                 processes_gone: Callable[[bool], str | None] | None = None):
        self.cfg = cfg
        self.log = log or (lambda m: print(f"ps scheduler: {m}", file=sys.stderr, flush=True))
        self.spawn_server = spawn_server
        # The launcher's view: a reason to end when its processes exited (a worker that
        # failed before registering would otherwise leave the job waiting for it).
        self.processes_gone = processes_gone or (lambda started: None)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.bind(address(cfg.scheduler))
        self.servers: dict[int, Node] = {}
        self.workers: dict[int, Node] = {}
        self.dead_workers: list[int] = []
        self.dead_servers: list[int] = []
        self.done: set[int] = set()
        self.started = False
        self.epoch = 0
        self.ring: Ring | None = None
        self.change: dict[str, Any] | None = None  # the ring change under way
        self.joining: list[Node] = []
        self.adding: list[tuple[bytes, Any, int]] = []  # add_server callers waiting
        self.barrier: dict[int, bytes] = {}
        self.checkpoint: dict[str, Any] | None = None
        self.stats_wait: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        self.restore = read_job_checkpoint(restore, cfg) if restore else {}
        self.longest_gap = 0.0  # the longest silence of a node that then spoke (seconds)
        self._last_watch: float | None = None

    def run(self) -> int:
        """Serve until every live worker is done: 0; 1 if no worker is left alive; 2 if the
        launcher's processes are gone."""
        try:
            while True:
                if self.sock.poll(int(POLL_S * 1000)):
                    self._receive_queued()
                self._watch()
                gone = self.dead_workers if self.cfg.on_worker_death == "continue" else []
                if self.started and len(self.done) + len(gone) == self.cfg.workers:
                    break
                reason = self.processes_gone(self.started)
                if reason:
                    self.log(f"ending the job: {reason}")
                    return 2
            return 0 if self.done else 1
        finally:
            for node in self.servers.values():
                send(self.sock, {"op": "stop"}, to=node.identity)
            self.sock.close(linger=500)  # term() waits (up to that) for the stops to leave
            self.ctx.term()

    # -- messages ----------------------------------------------------------------------------

    def _receive_queued(self) -> None:
        """Every message already here (up to DRAIN), not one: after this process was
        descheduled, the heartbeats that came meanwhile count before silence is judged."""
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._receive(frames)

    def _receive(self, frames: list[bytes]) -> None:
        who = frames[0]
        try:
            header, _ = wire.unpack(frames[1:])
        except wire.WireError as e:
            self.log(f"dropped a bad message from {who!r}: {e}")
            return
        op = header["op"]
        if op == "heartbeat":
            self._heard(str(header.get("node", "")))
            return
        handler = getattr(self, f"_on_{op}", None)
        if handler is None:
            self.log(f"unknown op {op!r} from {who!r}")
            return
        handler(who, header)

    def _heard(self, name: str) -> None:
        now = time.monotonic()
        for node in [*self.servers.values(), *self.workers.values()]:
            if node.name == name:
                if self.started:
                    self.longest_gap = max(self.longest_gap, now - node.last_seen)
                node.last_seen = now

    def _on_register(self, who: bytes, header: dict[str, Any]) -> None:
        if header.get("role") == "server":
            node = Node("", who, str(header["endpoint"]), int(header.get("pid", 0)))
            if self.started:
                self.joining.append(node)
                self._next_change()
            else:
                sid = len(self.servers)
                node.name = f"server{sid}"
                self.servers[sid] = node
        else:
            rank = int(header["rank"])
            if rank in self.dead_workers and self.cfg.on_worker_death == "wait":
                self._replace_worker(rank, who, int(header.get("pid", 0)))
                return
            if not 0 <= rank < self.cfg.workers or rank in self.workers:
                send(self.sock, {"op": "error", "message": f"worker rank {rank} is out of "
                                 f"[0, {self.cfg.workers}) or taken"}, to=who)
                return
            self.workers[rank] = Node(f"worker{rank}", who, pid=int(header.get("pid", 0)))
        if (not self.started and len(self.servers) == self.cfg.servers
                and len(self.workers) == self.cfg.workers):
            self._start()

    def _replace_worker(self, rank: int, who: bytes, pid: int) -> None:
        self.workers[rank] = Node(f"worker{rank}", who, pid=pid)
        self.dead_workers.remove(rank)
        self._event("worker_replaced", worker=rank, pid=pid)
        send(self.sock, {"op": "start", **self._members(), "replacement": True}, to=who)

    def _members(self) -> dict[str, Any]:
        assert self.ring is not None
        return {"ring": self.ring.spec(), "epoch": self.epoch,
                "endpoints": {str(s): self.servers[s].endpoint for s in self.ring.ids}}

    def _start(self) -> None:
        self.ring = Ring(sorted(self.servers), self.cfg.replicas)
        self.started = True
        for node in [*self.servers.values(), *self.workers.values()]:
            node.last_seen = time.monotonic()  # heartbeats start with the job
        restore = self.restore and {"restore": self.restore["path"],
                                    "files": self.restore["files"], "clock": self.restore["clock"]}
        for sid, node in self.servers.items():
            send(self.sock, {"op": "start", "sid": sid, **self._members(), **(restore or {})},
                 to=node.identity)
        for node in self.workers.values():
            send(self.sock, {"op": "start", **self._members(),
                             "clock": self.restore.get("clock", 0)}, to=node.identity)
        self.log(f"started: {len(self.servers)} servers, {len(self.workers)} workers, "
                 f"replicas {self.ring.replicas}, {self.cfg.consistency}"
                 f"{f' tau={self.cfg.tau}' if self.cfg.consistency == 'ssp' else ''}")

    # -- liveness ----------------------------------------------------------------------------

    def deadline(self) -> float:
        """Seconds of silence after which a node is dead (see MISSES)."""
        return max(self.cfg.heartbeat_timeout_s, MISSES * self.longest_gap)

    def _watch(self) -> None:
        if not self.started:
            return
        now = time.monotonic()
        # Time this process did not run (a loop takes POLL_S) is no node's silence.
        stalled = now - self._last_watch - POLL_S if self._last_watch is not None else 0.0
        self._last_watch = now
        if stalled > 0.05:
            for node in [*self.servers.values(), *self.workers.values()]:
                node.last_seen += stalled
        late = self.deadline()
        for sid, node in list(self.servers.items()):
            if now - node.last_seen > late and sid not in self.dead_servers:
                self._server_died(sid, node, by="heartbeat",
                                  silent_s=round(now - node.last_seen, 2))
        for rank, node in list(self.workers.items()):
            if (now - node.last_seen > late and rank not in self.dead_workers
                    and rank not in self.done):
                self._worker_died(rank, node, by="heartbeat",
                                  silent_s=round(now - node.last_seen, 2))

    def worker_exited(self, rank: int, code: int | None = None) -> bool:
        """The launcher saw this worker's process exit: unless it was done (it closed), it
        is dead now, without waiting for its heartbeats to stop (exit code 0 too: it
        ended without ``KVWorker.close``, e.g. by ``os._exit``). Returns whether it is
        dead."""
        if rank in self.done:
            return False
        node = self.workers.get(rank)
        if node is not None and rank not in self.dead_workers:
            self._worker_died(rank, node, by="exit", code=code)
        return True

    def server_exited(self, pid: int, code: int | None = None) -> None:
        """The launcher saw a server process exit while the job runs: dead now (its
        heartbeats would tell only after the deadline)."""
        for sid, node in list(self.servers.items()):
            if node.pid == pid and sid not in self.dead_servers:
                self._server_died(sid, node, by="exit", code=code)

    def _server_died(self, sid: int, node: Node, **how: Any) -> None:
        self.dead_servers.append(sid)
        self._event("server_dead", server=sid, pid=node.pid, **how)
        self._next_change()

    def _worker_died(self, rank: int, node: Node, **how: Any) -> None:
        """Name it; then either go on without it (its steps no longer awaited), or wait
        for a replacement of the same rank (the servers forget its unfinished step).
        ``how``: ``by`` ("exit": the launcher saw the process end; "heartbeat": silent
        past the deadline) and the exit code or the silence."""
        self.dead_workers.append(rank)
        self._event("worker_dead", worker=rank, pid=node.pid, policy=self.cfg.on_worker_death,
                    **how)
        live = [w for w in self.workers if w not in self.dead_workers]
        for s in self._live_servers():
            if self.cfg.on_worker_death == "wait":
                send(self.sock, {"op": "worker_lost", "worker": rank},
                     to=self.servers[s].identity)
            else:
                send(self.sock, {"op": "workers", "live": live}, to=self.servers[s].identity)
        for w in live:
            send(self.sock, {"op": "worker_dead", "worker": rank}, to=self.workers[w].identity)
        if self.cfg.on_worker_death == "continue":
            self._release_barrier()

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"event": kind, **fields})
        self.log(f"{kind}: {fields}")

    def _live_servers(self) -> list[int]:
        return [s for s in self.servers if s not in self.dead_servers]

    # -- ring changes ------------------------------------------------------------------------

    def _next_change(self) -> None:
        """Start a ring change if none is under way: servers that died leave, servers that
        registered join."""
        if self.change is not None or not self.started:
            return
        for node in self.joining:
            sid = max(self.servers) + 1
            node.name, node.last_seen = f"server{sid}", time.monotonic()
            self.servers[sid] = node
            send(self.sock, {"op": "start", "sid": sid, **self._members()}, to=node.identity)
            self._event("server_joined", server=sid)
        self.joining = []
        ids = self._live_servers()
        assert self.ring is not None
        if sorted(ids) == self.ring.ids:
            return
        if not ids:
            self.log("every server is dead: the job cannot go on")
            raise SystemExit(1)
        ring = Ring(ids, self.cfg.replicas)
        self.change = {"ring": ring, "epoch": self.epoch + 1, "waiting": set(ids)}
        # Servers joining copy nothing out, but prepare too (they hold no rows yet).
        members = {"ring": ring.spec(), "epoch": self.epoch + 1,
                   "endpoints": {str(s): self.servers[s].endpoint for s in ids}}
        for s in ids:
            send(self.sock, {"op": "prepare", **members}, to=self.servers[s].identity)

    def _on_prepared(self, _: bytes, header: dict[str, Any]) -> None:
        if self.change is None or int(header["epoch"]) != self.change["epoch"]:
            return
        self.change["waiting"].discard(int(header["sid"]))
        if self.change["waiting"]:
            return
        self.ring, self.epoch = self.change["ring"], self.change["epoch"]
        self.change = None
        members = self._members()
        for s in self._live_servers():
            send(self.sock, {"op": "commit", **members}, to=self.servers[s].identity)
        for w, node in self.workers.items():
            if w not in self.dead_workers:
                send(self.sock, {"op": "ring", **members}, to=node.identity)
        self._event("ring", epoch=self.epoch, servers=self.ring.ids)
        waiting, self.adding = self.adding, []
        for who, rid, known in waiting:
            if len(self.servers) > known:  # the server spawned for it has joined
                send(self.sock, {"op": "ok", "id": rid, "servers": self.ring.ids}, to=who)
            else:
                self.adding.append((who, rid, known))
        self._next_change()

    def _on_add_server(self, who: bytes, header: dict[str, Any]) -> None:
        if self.spawn_server is None:
            send(self.sock, {"op": "error", "id": header.get("id"), "message":
                             "add_server: this scheduler cannot start processes (it was not "
                             "started by pycomm.parallel.ps.launch); start a server with "
                             "PS_ROLE=server and it joins"}, to=who)
            return
        self.spawn_server()
        self.adding.append((who, header.get("id"), len(self.servers)))  # answered when in

    # -- barriers, checkpoints, the end --------------------------------------------------------

    def _on_barrier(self, who: bytes, header: dict[str, Any]) -> None:
        self.barrier[int(header["worker"])] = who
        self._release_barrier()

    def _release_barrier(self) -> None:
        waiting_for = self.dead_workers if self.cfg.on_worker_death == "wait" else []
        live = {w for w in self.workers if w not in self.done
                and (w not in self.dead_workers or w in waiting_for)}
        if self.barrier and live <= set(self.barrier):
            for who in self.barrier.values():
                send(self.sock, {"op": "barrier_done"}, to=who)
            self.barrier = {}

    def _on_checkpoint(self, who: bytes, header: dict[str, Any]) -> None:
        path = str(header["path"])
        os.makedirs(path, exist_ok=True)
        self.checkpoint = {"who": who, "id": header.get("id"), "path": path,
                           "clock": int(header.get("clock", 0)),
                           "waiting": set(self._live_servers())}
        for s in self._live_servers():
            send(self.sock, {"op": "checkpoint", "path": path, "clock": self.checkpoint["clock"]},
                 to=self.servers[s].identity)

    def _on_checkpointed(self, _: bytes, header: dict[str, Any]) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint["waiting"].discard(int(header["sid"]))
        if not self.checkpoint["waiting"]:
            # job.pt last: its presence says every server's file is complete.
            torch.save({"format": CHECKPOINT_FORMAT, "servers": self._live_servers(),
                        "clock": self.checkpoint["clock"], "workers": self.cfg.workers},
                       os.path.join(self.checkpoint["path"], "job.pt"))
            send(self.sock, {"op": "ok", "id": self.checkpoint["id"]}, to=self.checkpoint["who"])
            self.checkpoint = None

    def _on_stats(self, who: bytes, header: dict[str, Any]) -> None:
        if "sid" in header:  # a server's answer
            if self.stats_wait is not None:
                self.stats_wait["got"][int(header["sid"])] = header
                if set(self.stats_wait["got"]) >= set(self._live_servers()):
                    got = self.stats_wait["got"]
                    send(self.sock, {"op": "stats", "id": self.stats_wait["id"],
                                     "applied": sum(int(h["applied"]) for h in got.values()),
                                     "servers": sorted(got), "events": self.events,
                                     "server_pids": {str(s): self.servers[s].pid
                                                     for s in self._live_servers()}},
                         to=self.stats_wait["who"])
                    self.stats_wait = None
            return
        self.stats_wait = {"who": who, "id": header.get("id"), "got": {}}
        for s in self._live_servers():
            send(self.sock, {"op": "stats"}, to=self.servers[s].identity)

    def _on_done(self, who: bytes, header: dict[str, Any]) -> None:
        self.done.add(int(header["worker"]))
        self._release_barrier()
        # The worker exits on this answer: its exit is then never taken for a death.
        send(self.sock, {"op": "done", "id": header.get("id")}, to=who)


def main() -> None:
    cfg = JobConfig.from_env()
    sys.exit(Scheduler(cfg).run())


if __name__ == "__main__":
    main()
