"""One island's scheduler: a single order for every function from every controller.

Pathways' gang scheduling. Every node (one function on one mesh) of every connected
client passes through here, and each worker receives its nodes in the one order this
scheduler decides, so two programs whose meshes share workers run their collectives in
the same order on every shared worker and cannot deadlock each other. Clients share the
island by weight: stride scheduling, each node charged its expected time (the running
mean of that function's measured time on this island) over its client's weight, so a
client of weight 2 gets twice the island's time of one of weight 1.

A window bounds the nodes in flight per worker: enough that a worker always has the next
nodes (and has posted their receives), few enough that the order between clients is
still decided here, not by who submitted first.

With ``policy="off"`` there is no order: each node goes to each worker as it comes, in
the order its client sent it (the baseline that shows why the order is needed).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pickle
import queue
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from .fair_share import FairShare
from .gate import Gate, listen
from .protocol import Lit, Node, no_delay, put, take

DEFAULT_COST_S = 1e-3  # a function's expected time before it was ever measured


@dataclass
class _Client:
    conn: Connection


@dataclass
class _InFlight:
    client: int
    label: str
    pending: set[int]
    mesh: int = -1
    start: float = float("inf")
    end: float = 0.0
    failed: bool = False  # the client was told the node failed
    echo: str | None = None  # a rank's failure that only echoes a peer's abort, held back


# What pycomm's ops raise on a rank whose failure only echoes a peer's: the peer aborted
# the group (csrc/torch/backend/backend.cc), or the peer died (Shared::peer_gone and died()
# in csrc/core), which the scheduler names itself when the worker's connection closes. A
# mesh refused after such a failure quotes it, so its later nodes are echoes too.
ABORT_ECHO = re.compile(r"aborted the process group|rank \d+ \(pid \d+[^)]*\) died")


def is_abort_echo(error: str) -> bool:
    """Whether a rank's failure is only its peer's abort or death reaching it."""
    return ABORT_ECHO.search(error) is not None


def _ints(fields: list[Any]) -> bool:
    """Two integers (a worker's rank and pid)."""
    return len(fields) == 2 and all(isinstance(f, int) for f in fields)


class IslandScheduler:
    """The scheduler of island ``island`` (``size`` workers), serving on a free port."""

    def __init__(self, island: int, size: int, authkey: bytes, policy: str = "gang",
                 window: int = 16, host: str = "127.0.0.1"):
        if policy not in ("gang", "off"):
            raise ValueError(f"scheduler policy {policy!r}: 'gang' or 'off'")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"scheduler window {window!r}: nodes in flight per worker, >= 1")
        self.island, self.size, self.policy, self.window = island, size, policy, window
        self._listener = listen(host)
        self.gate = Gate(self._listener, authkey, self._admit)  # survives any caller
        self.address: tuple[str, int] = self._listener.address
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._new: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._reset_state()
        self._stopping = False
        self.epoch = 0
        self._threads = [threading.Thread(target=self.gate.serve, daemon=True, name="pw-accept"),
                         threading.Thread(target=self._loop, daemon=True, name="pw-sched")]
        for t in self._threads:
            t.start()

    def _reset_state(self) -> None:
        self.workers: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        self.dead: dict[int, str] = {}
        self.clients: dict[int, _Client] = getattr(self, "clients", {})
        self.queues: FairShare[Node] = getattr(self, "queues", FairShare())
        self.in_flight: dict[tuple[int, int], _InFlight] = {}
        self.load = [0] * self.size  # nodes in flight per worker
        self.meshes: dict[int, tuple[int, ...]] = {}
        self._mesh_ids = getattr(self, "_mesh_ids", itertools.count())  # unique across epochs
        self.mesh_owner: dict[int, int] = {}
        self.broken_meshes: set[int] = set()  # a function failed on them: no group reuse
        if not hasattr(self, "_ready"):
            self._ready = threading.Event()
        self.cost: dict[str, float] = {}

    # -- from other threads
    def call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)
        self._wake_w.send_bytes(b"!")

    def wait_ready(self, timeout_s: float) -> bool:
        """True once every worker of the island has said hello."""
        return self._ready.wait(timeout_s)

    def reset(self, epoch: int) -> None:
        """The island restarts: fail what was in flight, forget the workers."""
        self._ready = threading.Event()  # now: a wait_ready() after this sees the new one
        self.call_soon(lambda: self._reset(epoch))

    def relink(self, island: int, epoch: int) -> None:
        """Island ``island`` restarted: have this island's workers link to its new ones."""
        self.call_soon(lambda: self._on_relink(island, epoch))

    def stop(self) -> None:
        self.call_soon(self._stop)
        for t in self._threads[1:]:
            t.join(10.0)

    # -- the loop
    def _admit(self, conn: Connection) -> None:
        """An authenticated connection (from the gate's thread): to the loop."""
        self._new.put(no_delay(conn))
        self._wake_w.send_bytes(b"!")

    def _loop(self) -> None:
        pending: list[Connection] = []  # connections not yet introduced
        while not self._stopping:
            conns = [*self.workers.values(), *(c.conn for c in self.clients.values()),
                     *pending, self._wake_r]
            for ready in wait(conns):
                assert isinstance(ready, Connection)
                if ready is self._wake_r:
                    self._drain_wake(pending)
                    continue
                self._read(ready, pending)
            self._schedule()
        self._listener.close()

    def _read(self, conn: Connection, pending: list[Connection]) -> None:
        """Every message ``conn`` has ready (one wait() per burst, not per message). A
        frame that does not unpickle, or a first message that is no introduction, loses
        that connection alone (with a line on stderr), never the loop."""
        try:
            while True:
                message = take(conn)
                if conn in pending:
                    pending.remove(conn)
                    self._introduce(conn, message)
                else:
                    self._dispatch(conn, message)
                if not conn.poll(0):
                    return
        except (EOFError, OSError):
            self._lost(conn, pending)
        except Exception as e:
            print(f"pathways island {self.island} scheduler: closed a connection that sent "
                  f"what it cannot read: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            self._lost(conn, pending)
            conn.close()

    def _drain_wake(self, pending: list[Connection]) -> None:
        while self._wake_r.poll():
            self._wake_r.recv_bytes()
        while not self._new.empty():
            pending.append(self._new.get())
        while not self._calls.empty():
            self._calls.get()()

    def _introduce(self, conn: Connection, message: tuple[Any, ...]) -> None:
        """A new connection's first message: a worker's hello or a client's.

        Raises:
            ValueError: anything else.
        """
        kind, *fields = message if isinstance(message, tuple) and message else (None,)
        if kind == "hello" and _ints(fields) and 0 <= fields[0] < self.size:
            rank, pid = fields  # a worker
            if rank in self.workers:
                raise ValueError(f"a second worker says it is rank {rank}")
            self.workers[rank], self.pids[rank] = conn, pid
            if len(self.workers) == self.size:
                self._ready.set()
        elif kind == "client" and len(fields) == 2 and isinstance(fields[0], int) \
                and isinstance(fields[1], (int, float)) and fields[1] > 0:
            client, weight = fields
            self.clients[client] = _Client(conn)
            self.queues.add_client(client, float(weight))
            put(conn, ("welcome", self.island, self.size, self.epoch, self.policy))
        else:
            raise ValueError(f"a first message {str(message)[:60]} is no introduction")

    def _dispatch(self, conn: Connection, message: tuple[Any, ...]) -> None:
        """One message to its handler; a message that is not understood is dropped with
        a line on stderr, never the loop that serves every client of the island."""
        try:
            handler = getattr(self, f"_on_{message[0]}")
            handler(*message[1:])
        except Exception as e:
            print(f"pathways island {self.island} scheduler: dropped a message "
                  f"{str(message)[:120]}: {type(e).__name__}: {e}", file=sys.stderr)

    # -- clients' messages
    def _on_submit(self, client: int, nodes: list[Node]) -> None:
        for node in nodes:
            if self.policy == "off":
                self._start(node)
            else:
                self._enqueue(client, node)

    def _on_direct(self, client: int, node: Node, rank: int) -> None:
        """Policy off: one worker's part of a node, sent when its client chose."""
        self._track(node)
        self._to_worker(node, rank, ("run", node))

    def _on_mesh(self, client: int, node_id: int, shape: tuple[int, ...],
                 names: tuple[str, ...], ranks: tuple[int, ...] | None) -> None:
        chosen = ranks if ranks is not None else self._least_loaded(math.prod(shape))
        bad = [r for r in chosen if not 0 <= r < self.size]
        if bad or len(set(chosen)) != len(chosen) or len(chosen) != math.prod(shape):
            reason = (f"ranks {list(chosen)} for shape {tuple(shape)} on island {self.island} "
                      f"of {self.size} workers")
            put(self.clients[client].conn, ("mesh", node_id, None, reason, self.epoch))
            return
        mesh = next(self._mesh_ids)
        self.meshes[mesh], self.mesh_owner[mesh] = tuple(chosen), client
        put(self.clients[client].conn, ("mesh", node_id, mesh, tuple(chosen), self.epoch))
        everyone = tuple(range(self.size))  # every worker makes every group (mesh_context)
        built = Node(client, node_id, mesh, everyone, None,
                     [[Lit(tuple(chosen)), Lit(tuple(shape)), Lit(tuple(names))]] * self.size,
                     kind="mesh", label="mesh")
        self._on_submit(client, [built])

    def _on_drop(self, client: int, node_id: int, mesh: int) -> None:
        if self.mesh_owner.get(mesh) != client:  # another client's, or an old epoch's
            self._tell(client, ("done", node_id, 0.0, 0.0))
            return
        del self.meshes[mesh], self.mesh_owner[mesh]
        everyone = tuple(range(self.size))
        reuse = mesh not in self.broken_meshes  # a failed function may have aborted them
        self._on_submit(client, [Node(client, node_id, mesh, everyone, None,
                                      [[Lit(reuse)]] * self.size, kind="drop",
                                      label="drop")])

    def _on_send(self, client: int, rank: int, order: Any) -> None:
        self._to_rank(rank, ("send", order))

    def _on_fetch(self, client: int, request: int, rank: int, key: Any) -> None:
        if rank in self.dead:
            put(self.clients[client].conn, ("value", request, None, self.dead[rank]))
        else:
            self._to_rank(rank, ("fetch", client, request, key))

    def _on_release(self, client: int, rank: int, keys: list[Any]) -> None:
        self._to_rank(rank, ("release", keys))

    def _on_relink(self, island: int, epoch: int) -> None:
        for rank in list(self.workers):
            self._to_rank(rank, ("relink", island, epoch))

    def _on_bye(self, client: int) -> None:
        for rank in list(self.workers):  # its objects go with it
            self._to_rank(rank, ("forget_client", client))
        state = self.clients.pop(client, None)
        self.queues.remove_client(client)
        if state is not None:
            state.conn.close()

    # -- workers' messages
    def _on_done(self, client: int, node: int, rank: int, start: float, end: float) -> None:
        state = self._finish(client, node, rank)
        if state is None:
            return
        state.start, state.end = min(state.start, start), max(state.end, end)
        if not state.pending:
            del self.in_flight[(client, node)]
            seconds = state.end - state.start
            self.cost[state.label] = 0.8 * self.cost.get(state.label, seconds) + 0.2 * seconds
            if state.echo is not None:  # a rank failed: the node did
                self._tell_failed(client, node, state, state.echo)
            elif not state.failed:  # (a failure was told already)
                self._tell(client, ("done", node, state.start, state.end))

    def _on_failed(self, client: int, node: int, rank: int, error: str,
                   cause: bool = False) -> None:
        state = self._finish(client, node, rank)
        if state is None:
            return
        self.broken_meshes.add(state.mesh)
        # The client is told the cause: a rank whose function raised aborts the mesh,
        # and its peers' waits end with the abort, possibly reported first. Such an echo
        # is told only if no rank reports anything else (the raising rank reports at once).
        if cause or not is_abort_echo(error):
            self._tell_failed(client, node, state, error)
        elif state.echo is None:
            state.echo = error  # the first one, told below if it stays the only kind
        if not state.pending:
            if state.echo is not None:
                self._tell_failed(client, node, state, state.echo)
            del self.in_flight[(client, node)]

    def _tell_failed(self, client: int, node: int, state: _InFlight, error: str) -> None:
        if not state.failed:
            state.failed = True
            self._tell(client, ("failed", node, error))

    def _on_value(self, client: int, request: int, value: Any, error: str | None) -> None:
        self._tell(client, ("value", request, value, error))

    def _finish(self, client: int, node: int, rank: int) -> _InFlight | None:
        state = self.in_flight.get((client, node))
        if state is None or rank not in state.pending:
            return None
        state.pending.discard(rank)
        self.load[rank] -= 1
        return state

    # -- ordering
    def _enqueue(self, client: int, node: Node) -> None:
        self.queues.push(client, node)

    def _schedule(self) -> None:
        while (picked := self.queues.pop(
                self._room, lambda n: self.cost.get(n.label, DEFAULT_COST_S))) is not None:
            self._start(picked[1])

    def _room(self, node: Node) -> bool:
        return all(r in self.dead or self.load[r] < self.window for r in node.ranks)

    def _start(self, node: Node) -> None:
        dead = [r for r in node.ranks if r in self.dead]
        if dead:
            self._tell(node.client, ("failed", node.node, self.dead[dead[0]]))
            return
        self._track(node)
        message = pickle.dumps(("run", node), protocol=pickle.HIGHEST_PROTOCOL)  # once
        for rank in node.ranks:
            self._to_worker(node, rank, message)

    def _track(self, node: Node) -> None:
        key = (node.client, node.node)
        if key not in self.in_flight:
            self.in_flight[key] = _InFlight(node.client, node.label, set(node.ranks),
                                            node.mesh if node.kind == "call" else -1)
            for rank in node.ranks:
                self.load[rank] += 1

    def _least_loaded(self, n: int) -> tuple[int, ...]:
        use = [0] * self.size
        for ranks in self.meshes.values():
            for r in ranks:
                use[r] += 1
        return tuple(sorted(sorted(range(self.size), key=lambda r: (use[r], r))[:n]))

    # -- failures
    def _lost(self, conn: Connection, pending: list[Connection]) -> None:
        if conn in pending:
            pending.remove(conn)
            return
        for rank, worker in list(self.workers.items()):
            if worker is conn:
                del self.workers[rank]
                self._worker_died(rank)
        for cid, c in list(self.clients.items()):
            if c.conn is conn:
                del self.clients[cid]
                self.queues.remove_client(cid)

    def _worker_died(self, rank: int) -> None:
        error = (f"island {self.island} rank {rank} (pid {self.pids.get(rank, '?')}) died "
                 f"(its connection to the island's scheduler closed)")
        self.dead[rank] = error
        for (client, node), state in list(self.in_flight.items()):
            if rank in state.pending:  # the cause its peers' failures echo
                self._on_failed(client, node, rank, error, cause=True)
        for cid in self.clients:
            self._tell(cid, ("died", rank, error))

    def _reset(self, epoch: int) -> None:
        error = f"island {self.island} was restarted (epoch {epoch})"
        for (client, node), state in self.in_flight.items():
            if not state.failed:
                self._tell(client, ("failed", node, error))
        for cid, queued in self.queues.drain():
            self._tell(cid, ("failed", queued.node, error))
        for conn in self.workers.values():
            conn.close()
        self._reset_state()
        self.epoch = epoch
        for cid in self.clients:
            self._tell(cid, ("epoch", epoch))

    def _stop(self) -> None:
        for rank in list(self.workers):
            self._to_rank(rank, ("stop",))
        self._stopping = True

    # -- sending
    def _to_worker(self, node: Node, rank: int, message: tuple[Any, ...] | bytes) -> None:
        if not self._to_rank(rank, message):
            self._on_failed(node.client, node.node, rank, self.dead.get(
                rank, f"island {self.island} rank {rank} is not connected"))

    def _to_rank(self, rank: int, message: tuple[Any, ...] | bytes) -> bool:
        conn = self.workers.get(rank)
        if conn is None:
            return False
        try:
            if isinstance(message, bytes):
                conn.send_bytes(message)  # pickled already, for every rank alike
            else:
                put(conn, message)
            return True
        except OSError:
            return False

    def _tell(self, client: int, message: tuple[Any, ...]) -> None:
        state = self.clients.get(client)
        if state is not None:
            with contextlib.suppress(OSError):
                put(state.conn, message)
