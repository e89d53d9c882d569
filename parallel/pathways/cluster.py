"""A cluster: islands of long-lived workers, their schedulers, and the store they meet at.

``Cluster([4, 4])`` starts two islands of four workers on this host (or, with
``launcher=RayLauncher(...)``, wherever Ray places them) and one scheduler per island,
in this process. Controllers connect with ``cluster.client()`` or, from another process,
``Client(str(cluster.address))``. An island whose worker died can be restarted; the
other islands keep running.
"""

from __future__ import annotations

import datetime
import os
import time
import weakref

import torch.distributed as dist

from .address import ClusterAddress
from .client import Client
from .launch import Launcher, LocalLauncher, WorkerHandle, WorkerSpec
from .scheduler import IslandScheduler
from .startup import mark_launched, read_cause

_OPEN: weakref.WeakSet[Cluster] = weakref.WeakSet()


def live_worker_pids() -> set[int]:
    """The pids of every open cluster's workers (a test's leak check spares them)."""
    return {h.pid for c in list(_OPEN) for island in c.workers for h in island
            if h.poll() is None}


class Cluster:
    """Islands of ``islands[i]`` workers each.

    Args:
        islands: the number of workers of each island.
        launcher: what starts the workers (default: subprocesses of this host).
        policy: the schedulers' ``"gang"`` ordering, or ``"off"`` (no order: a baseline).
        timeout_s: every wait's limit (start-up, collectives, transfers).
        env: extra environment for the workers (``PYCOMM_*`` settings, say).
        host: the address the store and schedulers listen on (a host's own address when
            workers run on other hosts).
        window: nodes in flight per worker (each island's scheduler holds the rest, to
            order them between clients).

    Raises:
        RuntimeError: a worker that exits before its island is up (its exit status named).
    """

    def __init__(self, islands: list[int], launcher: Launcher | None = None,
                 policy: str = "gang", timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 window: int = 16):
        if not islands or any(not isinstance(n, int) or n < 1 for n in islands):
            raise ValueError(f"cluster: islands must be positive worker counts, got {islands}")
        self.sizes, self.timeout_s, self.env = list(islands), timeout_s, dict(env or {})
        self.launcher = launcher or LocalLauncher()
        self._authkey = os.urandom(16)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self._host = host
        self.schedulers = [IslandScheduler(i, n, self._authkey, policy, window, host)
                           for i, n in enumerate(self.sizes)]
        self.epochs = [0] * len(self.sizes)
        self.workers: list[list[WorkerHandle]] = [[] for _ in self.sizes]
        _OPEN.add(self)
        try:
            for island in range(len(self.sizes)):
                self._start_island(island)
            for island in range(len(self.sizes)):
                mark_launched(self.store, island, self.epochs[island])
            self._wait_islands(list(range(len(self.sizes))))
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> ClusterAddress:
        return ClusterAddress((self._host, self.store.port),
                              tuple(s.address for s in self.schedulers), tuple(self.sizes),
                              self._authkey.hex())

    def client(self, **kwargs: object) -> Client:
        """A controller on this cluster (``weight=``, ``dispatch=``, ``timeout_s=``)."""
        return Client(self.address, **kwargs)  # type: ignore[arg-type]

    def _spec(self, island: int, rank: int) -> WorkerSpec:
        env = {"PW_ISLAND": str(island), "PW_RANK": str(rank),
               "PW_SIZES": ",".join(map(str, self.sizes)),
               "PW_EPOCHS": ",".join(map(str, self.epochs)),
               "PW_STORE": f"{self._host}:{self.store.port}",
               "PW_SCHEDULER": "{}:{}".format(*self.schedulers[island].address),
               "PW_AUTHKEY": self._authkey.hex(), "PW_TIMEOUT_S": str(self.timeout_s),
               "PYCOMM_TIMEOUT_S": str(self.timeout_s), **self.env}
        return WorkerSpec(island, rank, env)

    def _start_island(self, island: int) -> None:
        self.workers[island] = [self.launcher.start(self._spec(island, r))
                                for r in range(self.sizes[island])]

    def _wait_islands(self, islands: list[int]) -> None:
        """Until every island of ``islands`` is up. Every worker of the cluster is watched,
        not only theirs: an island waits on the others' workers for its links, so the
        worker that died may be on another island."""
        deadline = time.monotonic() + self.timeout_s
        for island in islands:
            while not self.schedulers[island].wait_ready(0.05):
                self._raise_for_an_exited_worker(islands)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster: island {island} was not up in "
                                       f"{self.timeout_s:g} s")

    def _raise_for_an_exited_worker(self, starting: list[int]) -> None:
        for island, handles in enumerate(self.workers):
            for rank, handle in enumerate(handles):
                status = handle.poll()
                if status is not None:
                    raise RuntimeError(self._exited(island, rank, handle.pid, status, starting))

    def _exited(self, island: int, rank: int, pid: int, status: int,
                starting: list[int]) -> str:
        when = ("before its island was up" if island in starting else
                f"while island {starting[0]} was starting (its links need every worker)")
        cause = read_cause(self.store, island, rank, self.epochs[island])
        said = (f"; its cause:\n{cause}" if cause is not None else
                " and left no cause (killed, or it failed before it reached the store)")
        return (f"cluster: island {island} rank {rank} (pid {pid}) exited with status "
                f"{status} {when}{said}")

    def kill(self, island: int, rank: int) -> int:
        """Kill one worker (SIGKILL); its pid."""
        handle = self.workers[island][rank]
        handle.kill()
        handle.wait(10.0)
        return handle.pid

    def restart(self, island: int) -> None:
        """End every worker of ``island`` and start new ones; meshes on it are lost."""
        for handle in self.workers[island]:
            handle.kill()
        for handle in self.workers[island]:
            handle.wait(10.0)
        self.epochs[island] += 1
        self.schedulers[island].reset(self.epochs[island])
        self._start_island(island)
        mark_launched(self.store, island, self.epochs[island])
        for other, scheduler in enumerate(self.schedulers):
            if other != island:
                scheduler.relink(island, self.epochs[island])
        self._wait_islands([island])

    def close(self) -> None:
        """Stop the workers (asked first, killed if they do not go) and the schedulers."""
        for scheduler in self.schedulers:
            scheduler.stop()
        deadline = time.monotonic() + 10.0
        for handles in self.workers:
            for handle in handles:
                handle.wait(max(0.1, deadline - time.monotonic()))
        self.launcher.close()
        _OPEN.discard(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
