"""The data plane of a worker: objects sent to, and received from, other workers.

Inside an island the worker's own process group (pycomm: shared memory) carries them;
between islands a two-rank gloo group per pair of workers (:class:`Links`). Every
transfer is two messages: a header ``[kind, bytes]`` on ``tag``, then the payload on
``tag + 1``. With the shape known in advance (a :class:`Spec`) the receiver allocates
its buffer and posts both receives when the node arrives, before the sender has the
value; without one, it posts the payload's receive once the header has told its size.
A failed object is sent as an error (the payload then carries its message), so a
receiver never waits on a value that will not come.

One thread owns every send and receive, in the order they were asked for: the
controller's orders, the nodes' receives and the links' set-up never race each other.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from .objects import ObjectError, Objects
from .protocol import Recv, SendOrder, Spec, Where

TENSOR, PICKLED, ERROR = 0, 1, 2


class Links:
    """Gloo groups of two, one per pair of workers on different islands.

    Built in one order on every worker (pairs sorted by their members' global index), so
    that no two workers wait on each other's second pair: the first unbuilt pair in that
    order always has both its members at it.

    A transfer that fails on a pair (gloo closes a pair whose receive timed out, on that
    side, and the other side then finds it closed) marks it broken, from any thread, at
    once: the pair's generation, a counter in the store that both members read, goes up,
    and so does the cluster's count of breaks. The transfers thread of every worker reads
    that count before each transfer and while idle (every 0.1 s); where it moved, each of
    its pairs whose generation moved is built again, in the global order, so both members
    rebuild within moments of each other and later transfers between them arrive.
    """

    BREAKS = "pw/pairs/breaks"

    def __init__(self, store: dist.Store, me: Where, sizes: list[int], epochs: list[int],
                 timeout_s: float):
        self.store, self.me, self.sizes, self.epochs = store, me, list(sizes), list(epochs)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # peer -> (group, its index there, generation); group None: a rebuild failed
        self._pairs: dict[Where, tuple[Any, int, int]] = {}
        self._breaks_seen = 0

    def _index(self, w: Where) -> int:
        return sum(self.sizes[: w[0]]) + w[1]

    def _order(self, peers: list[Where]) -> list[Where]:
        mine = self._index(self.me)
        return sorted(peers, key=lambda p: tuple(sorted((mine, self._index(p)))))

    def _name(self, peer: Where) -> str:
        lo, hi = sorted((self.me, peer), key=self._index)
        return f"{lo[0]}.{lo[1]}e{self.epochs[lo[0]]}/{hi[0]}.{hi[1]}e{self.epochs[hi[0]]}"

    def _generation(self, peer: Where, bump: bool = False) -> int:
        return int(self.store.add(f"pw/pairgen/{self._name(peer)}", 1 if bump else 0))

    def _connect(self, peer: Where, generation: int) -> None:
        lo = min((self.me, peer), key=self._index)
        rank = 0 if lo == self.me else 1
        prefix = f"pw/pair/{self._name(peer)}/g{generation}/"
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, 2,
                                          self.timeout)
        except Exception:
            self._pairs[peer] = (None, 1 - rank, generation)
            raise
        self._pairs[peer] = (group, 1 - rank, generation)

    def build(self, islands: list[int]) -> None:
        """The pairs of this worker with every worker of ``islands`` (not its own)."""
        peers = [(i, r) for i in islands if i != self.me[0] for r in range(self.sizes[i])]
        self._breaks_seen = int(self.store.add(self.BREAKS, 0))
        for peer in self._order(peers):
            self._connect(peer, self._generation(peer))

    def renew(self, island: int, epoch: int) -> None:
        """``island`` was restarted: forget its old pairs, make the new ones."""
        self.epochs[island] = epoch
        for peer in [p for p in self._pairs if p[0] == island]:
            del self._pairs[peer]
        self.build([island])

    def broken(self, peer: Where) -> None:
        """A transfer with ``peer`` failed on its pair (any thread): both rebuild it."""
        if peer[0] != self.me[0] and peer in self._pairs:
            self._generation(peer, bump=True)
            self.store.add(self.BREAKS, 1)

    def heal(self) -> None:
        """(The transfers thread.) Build again every pair whose generation moved since
        this worker last looked; a rebuild that fails leaves the pair refusing."""
        breaks = int(self.store.add(self.BREAKS, 0))
        if breaks == self._breaks_seen:
            return
        self._breaks_seen = breaks
        for peer in self._order(list(self._pairs)):
            generation = self._generation(peer)
            if generation != self._pairs[peer][2]:
                # a failure leaves it refusing: its next use (pair) marks it broken again
                with contextlib.suppress(Exception):
                    self._connect(peer, generation)

    def pair(self, peer: Where) -> tuple[Any, int]:
        """The pair with ``peer``, built again first where it broke here or there."""
        if peer not in self._pairs:
            raise ObjectError(f"no link from island {self.me[0]} rank {self.me[1]} to island "
                              f"{peer[0]} rank {peer[1]}")
        self.heal()
        group, index, _ = self._pairs[peer]
        if group is None:
            self.broken(peer)  # both try again, at a new generation
            raise ObjectError(f"island {self.me[0]} rank {self.me[1]}: the link to island "
                              f"{peer[0]} rank {peer[1]} broke and could not be built again "
                              "yet")
        return group, index


class PendingRecv:
    """An object on its way here: :meth:`value` waits for it."""

    def __init__(self, transfers: Transfers, recv: Recv):
        self.recv = recv
        self._transfers = transfers
        self.header = torch.zeros(2, dtype=torch.int64)
        self.payload = recv.spec.empty() if recv.spec is not None else None
        self.posted: Future[list[Any]] = Future()

    def value(self, timeout_s: float) -> Any:
        """The object; ObjectError naming its sender if it stands for a failure."""
        works = self.posted.result(timeout_s)
        self._wait(works[0], timeout_s)
        kind, size = (int(v) for v in self.header)
        if self.payload is None:  # no spec: the header told the size
            self.payload = torch.empty(size, dtype=torch.uint8)
            works = [None, self._transfers.post(self.payload, self.recv.src, self.recv.tag + 1)
                     .result(timeout_s)]
        self._wait(works[1], timeout_s)
        return self._decode(kind)

    def _wait(self, work: Any, timeout_s: float) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            self._transfers.broken(self.recv.src)
            raise ObjectError(f"{self._whence()}: the transfer failed: {e}") from None

    def _decode(self, kind: int) -> Any:
        assert self.payload is not None
        if kind == TENSOR:
            return self.payload
        if kind == PICKLED:
            return pickle.loads(self.payload.numpy().tobytes())
        if self.recv.spec is None:
            raise ObjectError(self.payload.numpy().tobytes().decode(errors="replace"))
        raise ObjectError(f"{self._whence()}: its function failed (the controller has the "
                          "error)")

    def _whence(self) -> str:
        (island, rank), (client, node, k) = self.recv.src, self.recv.key
        return f"output {k} of node {node} (client {client}) from island {island} rank {rank}"


class Transfers:
    """The one thread that sends and receives this worker's objects."""

    def __init__(self, me: Where, objects: Objects, links: Links | None):
        self.me, self.objects, self.links = me, objects, links
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._in_flight: list[tuple[Any, torch.Tensor]] = []
        self._thread = threading.Thread(target=self._run, name="pw-transfers", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def broken(self, peer: Where) -> None:
        """A transfer with ``peer`` failed: its link (between islands) is built again."""
        if self.links is not None:
            self.links.broken(peer)

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join(30.0)

    def _run(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=0.1)
            except queue.Empty:  # idle: rebuild what broke, so both ends do it together
                self._heal()
                continue
            if task is None:
                return
            task()
            self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]

    def _heal(self) -> None:
        if self.links is not None:
            with contextlib.suppress(Exception):  # the store is gone: the cluster stops
                self.links.heal()

    # -- receiving
    def expect(self, recv: Recv) -> PendingRecv:
        """Post the receives of ``recv`` now (both, when its shape is known)."""
        pending = PendingRecv(self, recv)

        def post() -> None:
            try:
                works = [self._p2p(False, pending.header, recv.src, recv.tag)]
                if pending.payload is not None:
                    works.append(self._p2p(False, pending.payload, recv.src, recv.tag + 1))
                pending.posted.set_result(works)
            except Exception as e:
                self.broken(recv.src)
                pending.posted.set_exception(ObjectError(f"posting a receive: {e}"))
        self.submit(post)
        return pending

    def post(self, buf: torch.Tensor, src: Where, tag: int) -> Future[Any]:
        done: Future[Any] = Future()

        def post() -> None:
            try:
                done.set_result(self._p2p(False, buf, src, tag))
            except Exception as e:
                self.broken(src)
                done.set_exception(ObjectError(f"posting a receive: {e}"))
        self.submit(post)
        return done

    # -- sending
    def send_when_ready(self, order: SendOrder) -> None:
        """Send ``order.key`` to ``order.dst`` once it exists (or its error, if it fails)."""
        self.objects.when_ready(order.key, lambda value, error: self.submit(
            lambda: self._send(order, value, error)))

    def _send(self, order: SendOrder, value: Any, error: str | None) -> None:
        kind, payload = _encode(order.spec, value, error)
        header = torch.tensor([kind, payload.numel() * payload.element_size()],
                              dtype=torch.int64)
        try:
            for tensor, tag in ((header, order.tag), (payload, order.tag + 1)):
                self._in_flight.append((self._p2p(True, tensor, order.dst, tag), tensor))
        except Exception:  # the receiver learns of it from its own side (peer gone)
            self.broken(order.dst)

    def _p2p(self, is_send: bool, tensor: torch.Tensor, peer: Where, tag: int) -> Any:
        if peer[0] == self.me[0]:
            op = dist.isend if is_send else dist.irecv
            return op(tensor, peer[1], tag=tag)
        assert self.links is not None
        group, index = self.links.pair(peer)
        return group.send([tensor], index, tag) if is_send else group.recv([tensor], index, tag)


def _encode(spec: Spec | None, value: Any, error: str | None) -> tuple[int, torch.Tensor]:
    if error is None and spec is not None and not spec.matches(value):
        error = f"the value is not the declared {spec}"
    if error is not None:
        if spec is not None:  # the receiver's payload buffer is already posted: fill it
            return ERROR, spec.empty().zero_()
        return ERROR, _bytes(error.encode())
    if spec is not None:
        return TENSOR, value.detach().contiguous()
    return PICKLED, _bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data or b" "), dtype=torch.uint8)
