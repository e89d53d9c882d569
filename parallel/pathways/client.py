"""The controller's side: meshes, calls that return futures at once, and dispatch.

A :class:`Client` connects to every island's scheduler of a cluster. ``client.mesh``
asks an island for a virtual mesh; ``client.call(fn, mesh, *args)`` (or ``fn(mesh, ...)``
for a :func:`function`) returns futures for the outputs before anything ran. With
``dispatch="parallel"`` (the default) a call is sent at once, its inputs' transfers
ordered at the same time, so a whole chain is on the workers, receives posted, before
its first function ends; ``with client.program():`` sends every call made inside it in
one message per island. With ``dispatch="sequential"`` a call leaves only once its
inputs are done (the baseline Pathways measures its parallel dispatch against).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future as _Reply
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from .address import ClusterAddress
from .functions import sendable
from .futures import Future, PathwaysError, Shard
from .protocol import (
    Arg,
    Key,
    Lit,
    Local,
    Node,
    Recv,
    SendOrder,
    connect,
    put,
    take,
    transfer_tag,
)


@dataclass
class Mesh:
    """A virtual mesh of one island: ``size`` workers laid out as ``shape``."""

    client: Client
    island: int
    id: int
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...]
    epoch: int
    released: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    def release(self) -> None:
        """Give the mesh back (its groups are kept for the next mesh on the same ranks)."""
        self.client.release_mesh(self)


@dataclass(eq=False)
class _NodeState:
    island: int
    node: int
    event: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    inputs: list[Future] = field(default_factory=list)  # kept alive until this node ends
    held: tuple[Node, list[tuple[int, int, SendOrder]]] | None = None  # sequential dispatch


class Client:
    """One controller's connection to a cluster (see the module's docstring).

    Args:
        address: the cluster's :class:`ClusterAddress` (or its string).
        weight: this client's share of every island against other clients.
        dispatch: ``"parallel"`` or ``"sequential"``.
        timeout_s: how long a wait for a result may take before it raises.
        check_inputs: before a function runs, its ranks agree (one small all-reduce)
            that none of them lacks an input (a failed future); without it a rank whose
            input failed leaves the others in their collectives until the timeout.
    """

    def __init__(self, address: ClusterAddress | str, weight: float = 1.0,
                 dispatch: str = "parallel", timeout_s: float = 300.0,
                 check_inputs: bool = True):
        if dispatch not in ("parallel", "sequential"):
            raise ValueError(f"dispatch {dispatch!r}: 'parallel' or 'sequential'")
        self.address = ClusterAddress.parse(address) if isinstance(address, str) else address
        self.dispatch, self.timeout_s, self.check_inputs = dispatch, timeout_s, check_inputs
        self.authkey = bytes.fromhex(self.address.authkey)
        store = dist.TCPStore(*self.address.store, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self.id = int(store.add("pw/clients", 1)) - 1
        self._lock = threading.RLock()
        self._nodes: dict[tuple[int, int], _NodeState] = {}  # not yet done
        self._done: weakref.WeakValueDictionary[tuple[int, int], _NodeState] = (
            weakref.WeakValueDictionary())  # done, while a future still refers to it
        self._held: list[_NodeState] = []  # sequential dispatch: waiting for inputs
        self._replies: dict[int, _Reply[Any]] = {}
        self._meshes: dict[int, _Reply[Any]] = {}
        self._counter = itertools.count()
        self._forgotten: list[tuple[int, tuple[int, ...], Key]] = []
        self._batch: dict[int, list[Node]] | None = None
        self._sendable: dict[Any, bytes] = {}  # each function as nodes carry it
        self.epochs = [0] * len(self.address.sizes)
        self.policies = [""] * len(self.address.sizes)
        self._conns = [self._hello(i, a, weight) for i, a in enumerate(self.address.schedulers)]
        self._closed = False
        self._held_parts = []
        for island, conn in enumerate(self._conns):
            threading.Thread(target=self._receive, args=(island, conn), daemon=True,
                             name=f"pw-client-{island}").start()

    def _hello(self, island: int, address: tuple[str, int], weight: float) -> Connection:
        conn = connect(address, self.authkey)
        put(conn, ("client", self.id, weight))
        _, _, _, self.epochs[island], self.policies[island] = take(conn)
        return conn

    # -- meshes
    def mesh(self, island: int = 0, shape: tuple[int, ...] | int = 1,
             names: tuple[str, ...] | None = None, ranks: list[int] | None = None) -> Mesh:
        """A virtual mesh of ``island``: the least-used workers, or ``ranks``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"mesh: shape {shape}: every dimension a positive int")
        names = names or tuple(f"d{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"mesh: {len(names)} names {names} for {len(shape)} dimensions")
        if not 0 <= island < len(self._conns):
            raise ValueError(f"mesh: island {island}, the cluster has {len(self._conns)}")
        node = next(self._counter)
        reply: _Reply[Any] = _Reply()
        with self._lock:
            self._meshes[node] = reply
            self._nodes[(island, node)] = _NodeState(island, node)
        self._to(island, ("mesh", self.id, node, shape, names,
                          None if ranks is None else tuple(ranks)))
        mesh_id, chosen, epoch = reply.result(self.timeout_s)
        if mesh_id is None:
            raise ValueError(f"mesh: cannot place {chosen}")
        return Mesh(self, island, mesh_id, chosen, shape, names, epoch)

    def release_mesh(self, mesh: Mesh) -> None:
        if mesh.released or mesh.epoch != self.epochs[mesh.island]:
            mesh.released = True  # an old epoch's mesh went with its island
            return
        mesh.released = True
        node = next(self._counter)
        with self._lock:
            self._nodes[(mesh.island, node)] = _NodeState(mesh.island, node)
        self._to(mesh.island, ("drop", self.id, node, mesh.id))

    # -- calls
    def call(self, fn: Callable[..., Any], mesh: Mesh, *args: Any, out: Any = None,
             **kwargs: Any) -> Any:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank of ``mesh``; its future(s) now."""
        self._check_callable(fn, mesh)
        specs = tuple(out) if isinstance(out, tuple | list) else (out,)
        node_id = next(self._counter)
        per_rank, sends, inputs = self._arguments(mesh, args)
        node = Node(self.id, node_id, mesh.id, mesh.ranks, self._sendable[fn], per_rank,
                    {k: Lit(_literal(v, k)) for k, v in kwargs.items()}, len(specs), specs,
                    label=getattr(fn, "__qualname__", "function"), agree=self.check_inputs)
        state = _NodeState(mesh.island, node_id, inputs=inputs)
        with self._lock:
            self._nodes[(mesh.island, node_id)] = state
            if self.dispatch == "sequential" and inputs:
                state.held = (node, sends)
                self._held.append(state)
                self._release_held()
            else:
                self._send_node(mesh.island, node, sends)
        futures = tuple(Future(self, mesh, node_id, k, s, state) for k, s in enumerate(specs))
        self._flush_forgotten()
        return futures if isinstance(out, tuple | list) else futures[0]

    def _check_callable(self, fn: Callable[..., Any], mesh: Mesh) -> None:
        if mesh.client is not self:
            raise ValueError("call: the mesh belongs to another client")
        if mesh.epoch != self.epochs[mesh.island]:
            raise PathwaysError(f"mesh on island {mesh.island} was lost when the island "
                                f"restarted (epoch {mesh.epoch} -> "
                                f"{self.epochs[mesh.island]}); ask for a new mesh")
        if fn not in self._sendable:
            self._sendable[fn] = pickle.dumps(sendable(fn), protocol=pickle.HIGHEST_PROTOCOL)
        if mesh.released:
            raise PathwaysError(f"call: mesh {mesh.id} of island {mesh.island} was released")

    def _arguments(self, mesh: Mesh, args: tuple[Any, ...]
                   ) -> tuple[list[list[Arg]], list[tuple[int, int, SendOrder]], list[Future]]:
        """Each rank's arguments, the sends they need (island, rank, order), the inputs."""
        per_rank: list[list[Arg]] = [[] for _ in mesh.ranks]
        sends: list[tuple[int, int, SendOrder]] = []
        inputs: list[Future] = []
        for i, arg in enumerate(args):
            if not isinstance(arg, Future | Shard):
                lit = Lit(_literal(arg, i))
                for mine in per_rank:
                    mine.append(lit)
                continue
            future = arg.future if isinstance(arg, Shard) else arg
            self._check_input(i, future)
            inputs.append(future)
            if isinstance(arg, Future) and future.mesh.size != mesh.size:
                raise ValueError(
                    f"call: argument {i} is sharded over {future.mesh.size} ranks "
                    f"{future.mesh.shape}, the mesh has {mesh.size} {mesh.shape}; pass "
                    "future.shard(i) to give every rank one shard")
            for p, rank in enumerate(mesh.ranks):
                src = (future.mesh.island, future.mesh.ranks[
                    arg.position if isinstance(arg, Shard) else p])
                if src == (mesh.island, rank):
                    per_rank[p].append(Local(future.key))
                    continue
                tag = transfer_tag(self.id, next(self._counter))
                per_rank[p].append(Recv(src, future.key, tag, future.spec))
                sends.append((src[0], src[1], SendOrder(future.key, (mesh.island, rank), tag,
                                                        future.spec)))
        return per_rank, sends, inputs

    def _check_input(self, i: int, future: Future) -> None:
        if future.client is not self:
            raise ValueError(f"call: argument {i} is another client's future (client "
                             f"{future.client.id}); only a client's own futures are inputs")
        if future.mesh.epoch != self.epochs[future.mesh.island]:
            raise PathwaysError(f"call: argument {i} was on island {future.mesh.island} "
                                "before it restarted; its shards are gone")

    def _send_node(self, island: int, node: Node, sends: list[tuple[int, int, SendOrder]]
                   ) -> None:
        for src_island, rank, order in sends:
            self._to(src_island, ("send", self.id, rank, order))
        if self._batch is not None:
            self._batch.setdefault(island, []).append(node)
        elif self.policies[island] == "off" and self._hold_parts:
            self._held_parts.extend((island, node, rank) for rank in node.ranks)
        else:
            self._to(island, ("submit", self.id, [node]))

    # Policy "off" only, a test's knob: keep each node's part for each worker until
    # send_part(), so that a test decides the order in which workers get them.
    _hold_parts = False
    _held_parts: list[tuple[int, Node, int]]

    def _send_part(self, index: int) -> None:
        """Send held part ``index`` (one node's message to one worker; policy off)."""
        island, node, rank = self._held_parts[index]
        self._to(island, ("direct", self.id, node, rank))

    @contextlib.contextmanager
    def program(self) -> Iterator[None]:
        """Every call inside is sent at the end, in one message per island."""
        with self._lock:
            outer, self._batch = self._batch, self._batch if self._batch is not None else {}
        try:
            yield
        finally:
            with self._lock:
                batch, self._batch = self._batch, outer
                if outer is None and batch:
                    for island, nodes in batch.items():
                        self._to(island, ("submit", self.id, nodes))

    # -- sequential dispatch
    def _release_held(self) -> None:
        for state in list(self._held):
            assert state.held is not None
            node, sends = state.held
            failed = [f for f in state.inputs if self._state(f).error is not None]
            if failed:
                state.held = None
                self._held.remove(state)
                self._finish(state, error=f"an input failed: {self._state(failed[0]).error}")
            elif all(self._state(f).event.is_set() for f in state.inputs):
                state.held = None
                self._held.remove(state)
                self._send_node(state.island, node, sends)

    def _state(self, future: Future) -> _NodeState:
        return future.state

    # -- results
    def node_state(self, island: int, node: int) -> _NodeState:
        state = self._nodes.get((island, node)) or self._done.get((island, node))
        if state is None:
            raise LookupError(f"client {self.id}: no node {node} on island {island}")
        return state

    def wait_node(self, island: int, node: int, timeout: float | None) -> None:
        state = self.node_state(island, node)
        limit = self.timeout_s if timeout is None else timeout
        if not state.event.wait(limit):
            raise TimeoutError(f"node {node} on island {island} did not finish in {limit:g} s")
        if state.error is not None:
            raise PathwaysError(state.error)

    def fetch(self, future: Future, position: int, timeout: float | None) -> Any:
        self.wait_node(future.mesh.island, future.node, timeout)  # failed: raise, now
        reply: _Reply[Any] = _Reply()
        request = next(self._counter)
        with self._lock:
            self._replies[request] = reply
        rank = future.mesh.ranks[position]
        self._to(future.mesh.island, ("fetch", self.id, request, rank, future.key))
        try:
            value, error = reply.result(self.timeout_s if timeout is None else timeout)
        finally:
            with self._lock:
                self._replies.pop(request, None)
        if error is not None:
            raise PathwaysError(error)
        return value

    def timings(self, futures: list[Future]) -> list[tuple[float, float]]:
        """The (start, end) of each future's node on the workers' monotonic clock."""
        return [(self._state(f).start, self._state(f).end) for f in futures]

    # -- releasing
    def forget(self, future: Future) -> None:
        """A future was dropped: its shards may go (sent with the next message)."""
        if not self._closed:
            self._forgotten.append((future.mesh.island, future.mesh.ranks, future.key))

    def _flush_forgotten(self) -> None:
        if len(self._forgotten) < 64:
            return
        batch, self._forgotten = self._forgotten, []
        by_rank: dict[tuple[int, int], list[Key]] = {}
        for island, ranks, key in batch:
            for rank in ranks:
                by_rank.setdefault((island, rank), []).append(key)
        for (island, rank), keys in by_rank.items():
            self._to(island, ("release", self.id, rank, keys))

    # -- the receiving threads
    def _receive(self, island: int, conn: Connection) -> None:
        try:
            while True:
                self._on_message(island, take(conn))
        except (EOFError, OSError, TypeError):  # TypeError: closed under recv (close())
            self._island_lost(island)

    def _on_message(self, island: int, message: tuple[Any, ...]) -> None:
        what = message[0]
        with self._lock:
            if what == "done":
                _, node, start, end = message
                state = self._nodes.get((island, node))
                if state is not None:
                    state.start, state.end = start, end
                    self._finish(state)
            elif what == "failed":
                _, node, error = message
                state = self._nodes.get((island, node))
                if state is not None:
                    self._finish(state, error=error)
            elif what == "value":
                _, request, value, error = message
                reply = self._replies.pop(request, None)
                if reply is not None:  # else: its waiter gave up
                    reply.set_result((value, error))
            elif what == "mesh":
                _, node, mesh_id, ranks, epoch = message
                self._meshes.pop(node).set_result((mesh_id, ranks, epoch))
                if mesh_id is None and (island, node) in self._nodes:  # refused: none will run
                    self._finish(self._nodes[(island, node)], error=str(ranks))
            elif what == "epoch":
                self.epochs[island] = message[1]
            elif what == "died":
                pass  # the nodes it fails come one by one, as "failed"

    def _finish(self, state: _NodeState, error: str | None = None) -> None:
        if state.event.is_set():
            return
        state.error = error
        state.inputs = []
        state.event.set()
        key = (state.island, state.node)
        self._nodes.pop(key, None)
        self._done[key] = state  # kept while a future holds it
        if self.dispatch == "sequential":
            self._release_held()

    def _island_lost(self, island: int) -> None:
        if self._closed:
            return
        with self._lock:
            for state in list(self._nodes.values()):
                if state.island == island:
                    self._finish(state, error=f"island {island}'s scheduler is gone")
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_result((None, f"island {island}'s scheduler is gone"))

    def _to(self, island: int, message: tuple[Any, ...]) -> None:
        if self._closed and message[0] != "bye":
            raise PathwaysError(f"client {self.id}: the client is closed")
        with self._lock:
            put(self._conns[island], message)

    def close(self) -> None:
        """Leave the cluster (the workers go on serving other clients)."""
        if self._closed:
            return
        self._closed = True
        for island, conn in enumerate(self._conns):
            with contextlib.suppress(OSError):
                self._to(island, ("bye", self.id))
                conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _literal(value: Any, where: int | str) -> Any:
    """A literal argument, checked: nothing that only means something here."""
    if isinstance(value, Mesh | Client):
        raise TypeError(f"call: argument {where} is a {type(value).__name__}, which stays on "
                        "the controller")
    inner = value.values() if isinstance(value, dict) else value
    if isinstance(value, Future | Shard) or (isinstance(value, list | tuple | dict) and any(
            isinstance(v, Future | Shard) for v in inner)):
        raise TypeError(f"call: argument {where} holds a future inside a container (or as a "
                        "keyword): pass futures as positional arguments of their own")
    return value
