"""Stride scheduling (Waldspurger and Weihl, 1995): shares of an island by weight.

Each client has a virtual time, advanced by the expected cost of each node it is given
over its weight; the next node goes to the client with the least virtual time among
those that have one ready. A client that comes back from idle starts at the least
virtual time of the busy ones: time it did not ask for is not owed to it later.

Example (weights 1 and 2, equal costs): A B B A B B ... over any long window, B gets
two thirds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Queue(Generic[T]):
    weight: float
    items: deque[T] = field(default_factory=deque)
    virtual: float = 0.0


class FairShare(Generic[T]):
    """Per-client FIFO queues, drained in stride order."""

    def __init__(self) -> None:
        self._queues: dict[int, _Queue[T]] = {}

    def add_client(self, client: int, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"client {client}: weight must be positive, got {weight}")
        self._queues[client] = _Queue(float(weight))

    def remove_client(self, client: int) -> list[T]:
        """Forget ``client``; the items it still had queued."""
        queue = self._queues.pop(client, None)
        return list(queue.items) if queue else []

    def push(self, client: int, item: T) -> None:
        queue = self._queues[client]
        if not queue.items:  # back from idle
            busy = [q.virtual for q in self._queues.values() if q.items]
            queue.virtual = max(queue.virtual, min(busy, default=queue.virtual))
        queue.items.append(item)

    def pop(self, can_start: Callable[[T], bool], cost: Callable[[T], float]
            ) -> tuple[int, T] | None:
        """The next item (and its client) among heads that ``can_start``, or None."""
        ready = [(q.virtual, c) for c, q in self._queues.items()
                 if q.items and can_start(q.items[0])]
        if not ready:
            return None
        _, client = min(ready)
        queue = self._queues[client]
        item = queue.items.popleft()
        queue.virtual += cost(item) / queue.weight
        return client, item

    def drain(self) -> list[tuple[int, T]]:
        """Every queued item, the queues emptied."""
        items = [(c, item) for c, q in self._queues.items() for item in q.items]
        for q in self._queues.values():
            q.items.clear()
        return items
