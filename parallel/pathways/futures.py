"""Handles to a function's outputs, which stay on the workers until someone asks.

A :class:`Future` names one output of one node: a shard per rank of the node's mesh.
Passed to another call it is a dataflow edge (the shards move worker to worker); its
values reach the controller only through :meth:`Future.result`. Dropping the last
reference to a future lets the workers free its shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .protocol import Key, Spec

if TYPE_CHECKING:
    from .client import Client, Mesh


class PathwaysError(RuntimeError):
    """A node that failed: the message names the island, the rank and the function."""


class Future:
    """Output ``index`` of node ``node`` of ``client``, sharded over ``mesh``."""

    def __init__(self, client: Client, mesh: Mesh, node: int, index: int, spec: Spec | None,
                 state: Any):
        self.client, self.mesh, self.node, self.index, self.spec = (
            client, mesh, node, index, spec)
        self.state = state  # the client's record of the node (kept alive by its futures)

    @property
    def key(self) -> Key:
        return (self.client.id, self.node, self.index)

    def done(self) -> bool:
        """True once the node finished on every rank (or failed)."""
        return bool(self.state.event.is_set())

    def wait(self, timeout: float | None = None) -> None:
        """Block until the node finished; PathwaysError if it failed."""
        self.client.wait_node(self.mesh.island, self.node, timeout)

    def exception(self, timeout: float | None = None) -> PathwaysError | None:
        try:
            self.wait(timeout)
        except PathwaysError as e:
            return e
        return None

    def result(self, shard: int | None = None, timeout: float | None = None) -> Any:
        """The value of one shard (``shard``: its position in the mesh), or the list of
        every shard's value; fetched from the workers now."""
        if shard is not None:
            if not 0 <= shard < self.mesh.size:  # before a fetch: a clear error, not a peer's
                raise IndexError(f"shard {shard} of a future on a mesh of {self.mesh.size} "
                                 "(result(shard, timeout): a timeout goes by name)")
            return self.client.fetch(self, shard, timeout)
        return [self.client.fetch(self, i, timeout) for i in range(self.mesh.size)]

    def shard(self, position: int) -> Shard:
        """This output's shard at ``position``, as an argument every rank receives."""
        if not 0 <= position < self.mesh.size:
            raise IndexError(f"shard {position} of a future on a mesh of {self.mesh.size}")
        return Shard(self, position)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.forget(self)

    def __repr__(self) -> str:
        return (f"Future(node {self.node} output {self.index} on island {self.mesh.island} "
                f"ranks {list(self.mesh.ranks)})")


class Shard:
    """One shard of a future, given whole to every rank of the receiving mesh."""

    def __init__(self, future: Future, position: int):
        self.future, self.position = future, position
