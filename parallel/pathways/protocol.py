"""What the controller, the island schedulers and the workers say to each other.

The control plane is small pickled messages over authenticated local sockets
(``multiprocessing.connection``: a shared key, so only processes the cluster started or
was given the key talk to it). Bulk data never travels here: a function's outputs stay
on its workers and move worker to worker (see :mod:`pycomm.parallel.pathways.transfer`), and
reach the controller only when it asks for them (``fetch``).

A node is one function call on one mesh. Its arguments are given per mesh position, each
one of: a literal value (the same for every rank), an object this worker already holds
(``Local``), or an object another worker sends (``Recv``, whose tags the controller
picked and also gave the sender).
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Client as _connect
from multiprocessing.connection import Connection
from typing import Any

import torch

Key = tuple[int, int, int]  # (client, node, output index): one output's shard on a worker
Where = tuple[int, int]  # (island, rank within the island)


@dataclass(frozen=True)
class Spec:
    """A shard's shape and dtype, known before the function runs: with it a receiver
    allocates the buffer and posts its receive before the sender has the value."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)

    def matches(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and tuple(value.shape) == self.shape
                and value.dtype == self.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def spec(shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype = torch.float32) -> Spec:
    """The :class:`Spec` of a tensor shard (``pw.spec((4, 8), torch.float64)``)."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    return Spec(tuple(int(d) for d in dims), dtype)


@dataclass(frozen=True)
class Local:
    """An argument this worker already holds."""

    key: Key


@dataclass(frozen=True)
class Recv:
    """An argument another worker sends: from ``src``, on tags ``tag`` (header) and
    ``tag + 1`` (payload); ``spec`` when its shape is known in advance."""

    src: Where
    key: Key
    tag: int
    spec: Spec | None


@dataclass(frozen=True)
class Lit:
    """A literal argument, the same on every rank of the mesh."""

    value: Any


Arg = Local | Recv | Lit


@dataclass
class Node:
    """One function call on one mesh, as an island's workers receive it."""

    client: int
    node: int
    mesh: int
    ranks: tuple[int, ...]  # the mesh's ranks of the island, in mesh order
    fn: bytes | None  # the function, pickled (by reference or by value); None: built-in
    args: list[list[Arg]]  # per mesh position
    kwargs: dict[str, Arg] = field(default_factory=dict)  # literals only: the same everywhere
    n_out: int = 1
    specs: tuple[Spec | None, ...] = (None,)
    kind: str = "call"  # "call", or "mesh": make the mesh's groups (args: shape, names)
    label: str = ""  # the function's name, for messages and the scheduler's cost estimates
    agree: bool = True  # the ranks agree that every input is there before running

    def output_keys(self) -> list[Key]:
        return [(self.client, self.node, k) for k in range(self.n_out)]


@dataclass(frozen=True)
class SendOrder:
    """Send one object, once it exists, to ``dst`` on tags ``tag`` and ``tag + 1``."""

    key: Key
    dst: Where
    tag: int
    spec: Spec | None


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    return no_delay(_connect(address, authkey=authkey))


def no_delay(conn: Connection) -> Connection:
    """TCP_NODELAY on ``conn``: small messages leave at once. Without it Nagle's
    algorithm holds a message until the last one is acknowledged, and the peer's delayed
    acknowledgement makes that 40 ms: a stall in the middle of a chain of calls."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()
    return conn


def put(conn: Connection, message: Any) -> None:
    """Send with plain pickle: ``Connection.send`` would share tensors' storage through
    file descriptors (torch's reductions), which needs a channel no peer has here."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def take(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def transfer_tag(client: int, serial: int) -> int:
    """Two tags per transfer (header, payload), distinct for 2^20 transfers in flight
    per client and 1024 clients, and positive in 31 bits as every engine accepts."""
    return ((client & 0x3FF) << 21) | ((serial & 0xFFFFF) << 1)
