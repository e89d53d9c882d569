"""Workers as Ray actors: a launcher for many hosts.

Ray only starts and places the workers: each island gets one placement group (one bundle
per worker, ``STRICT_PACK``, so that an island's workers share a host and talk over
shared memory), and each worker is an actor scheduled into its bundle, the actor's
process being the worker process itself (its ``main()`` runs in a thread of the actor).
The data plane stays pycomm/gloo: no tensor goes through Ray's object store. Every host
needs pycomm installed (or shipped in ``runtime_env``), since the actor imports this
module and the worker's entry point::

    launcher = RayLauncher(island_sizes=[4, 4], address="auto")
    handle = launcher.start(WorkerSpec(island=0, rank=0, env={"PW_...": "..."}))
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import traceback
from typing import Any

from .._optional import require
from .launch import WorkerHandle, WorkerSpec

_PURPOSE = "pycomm.parallel.pathways.ray_launch (workers as Ray actors on many hosts)"
ray = require("ray", _PURPOSE)
_strategies = require("ray.util.scheduling_strategies", _PURPOSE)

KILLED = -9  # poll()'s status for a worker whose actor (process) died


class _WorkerActor:
    """The worker process: runs the entry point in a thread, answers polls meanwhile."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._status: int | None = None

    def run(self, env: dict[str, str], entry: str) -> int:
        """Start ``entry`` ("module:function") with ``env`` added; this process's pid."""
        os.environ.update(env)
        module, _, name = entry.partition(":")
        target = getattr(importlib.import_module(module), name or "main")
        self._thread = threading.Thread(target=self._main, args=(target,), daemon=True,
                                        name="pathways-worker")
        self._thread.start()
        return os.getpid()

    def _main(self, target: Any) -> None:
        try:
            target()
            self._status = 0
        except SystemExit as exit_:
            self._status = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
            self._status = 1

    def pid(self) -> int:
        return os.getpid()

    def poll(self) -> int | None:
        return None if self._thread is None or self._thread.is_alive() else self._status


_Actor = ray.remote(max_concurrency=2, max_restarts=0)(_WorkerActor)


class RayWorker:
    """A :class:`WorkerHandle` over one worker actor."""

    def __init__(self, actor: Any, pid: int, poll_timeout: float):
        self._actor = actor
        self.pid = pid
        self._poll_timeout = poll_timeout
        self._status: int | None = None

    def poll(self) -> int | None:
        if self._status is None:
            try:
                self._status = ray.get(self._actor.poll.remote(), timeout=self._poll_timeout)
            except ray.exceptions.GetTimeoutError:
                return None  # busy or slow: not known to have ended
            except ray.exceptions.ActorUnavailableError:
                return None  # unreachable for now (no restarts, so it comes back or dies)
            except ray.exceptions.RayActorError:
                self._status = KILLED
        return self._status

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)
        if self._status is None:
            self._status = KILLED

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return status


class RayLauncher:
    """Workers as Ray actors, each island's in one STRICT_PACK placement group.

    ``address`` goes to ``ray.init`` when Ray is not initialised yet (None: a local Ray,
    with ``num_cpus`` CPUs); ``island_sizes[i]`` is island i's number of workers (its
    bundles); ``cpus_per_worker`` may be fractional (on a small host, 8 workers x 0.5).
    ``entry`` is the worker's "module:function"; ``runtime_env`` goes to each actor.
    """

    def __init__(self, island_sizes: list[int], address: str | None = None,
                 cpus_per_worker: float = 0.5, runtime_env: dict[str, Any] | None = None,
                 entry: str = "pycomm.parallel.pathways.worker:main", num_cpus: int | None = None,
                 start_timeout: float = 120.0, poll_timeout: float = 1.0):
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, num_cpus=num_cpus if address is None else None)
        self.island_sizes = list(island_sizes)
        self.cpus_per_worker = cpus_per_worker
        self.runtime_env = runtime_env
        self.entry = entry
        self.start_timeout = start_timeout
        self.poll_timeout = poll_timeout
        self._groups: dict[int, Any] = {}
        self._started: list[RayWorker] = []

    def _group(self, island: int) -> Any:
        """Island ``island``'s placement group, created (and waited for) on first use."""
        if island not in self._groups:
            size = self.island_sizes[island]
            pg = ray.util.placement_group([{"CPU": self.cpus_per_worker}] * size,
                                          strategy="STRICT_PACK",
                                          name=f"pathways-{os.getpid()}-{id(self):x}-{island}")
            try:
                ray.get(pg.ready(), timeout=self.start_timeout)
            except ray.exceptions.GetTimeoutError:
                ray.util.remove_placement_group(pg)
                raise RuntimeError(
                    f"island {island}: {size} x {self.cpus_per_worker} CPU on one host not "
                    f"placed in {self.start_timeout} s (free: {ray.available_resources()})"
                ) from None
            self._groups[island] = pg
        return self._groups[island]

    def start(self, spec: WorkerSpec) -> WorkerHandle:
        if not 0 <= spec.rank < self.island_sizes[spec.island]:
            raise ValueError(f"rank {spec.rank} outside island {spec.island} "
                             f"of {self.island_sizes[spec.island]}")
        strategy = _strategies.PlacementGroupSchedulingStrategy(
            placement_group=self._group(spec.island), placement_group_bundle_index=spec.rank)
        options: dict[str, Any] = {"num_cpus": self.cpus_per_worker,
                                   "scheduling_strategy": strategy}
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        actor = _Actor.options(**options).remote()
        try:
            pid = ray.get(actor.run.remote(dict(spec.env), self.entry),
                          timeout=self.start_timeout)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        handle = RayWorker(actor, pid, self.poll_timeout)
        self._started.append(handle)
        return handle

    def close(self) -> None:
        for handle in self._started:
            handle.kill()
        self._started.clear()
        for pg in self._groups.values():
            ray.util.remove_placement_group(pg)
        self._groups.clear()
        if self._owns_ray:
            ray.shutdown()
