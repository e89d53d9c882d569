"""How workers come to be: the launcher interface, and the built-in one for this host.

A launcher starts one worker process per :class:`WorkerSpec` and hands back a handle the
cluster polls (a worker that exits is a failure of its island). The built-in launcher
starts ``python -m pycomm.parallel.pathways.worker`` subprocesses;
:mod:`pycomm.parallel.pathways.ray_launch` starts the same worker inside Ray actors (one
placement-group bundle per worker), for many hosts. Either way the worker's settings travel
in its environment (``PW_*``), so the worker's code is one and the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its place, and the environment its settings travel in."""

    island: int
    rank: int
    env: dict[str, str] = field(default_factory=dict)  # PW_* settings, added to os.environ


class WorkerHandle(Protocol):
    """What the cluster needs of a started worker."""

    pid: int

    def poll(self) -> int | None:
        """The exit status once the worker has ended, else None."""

    def kill(self) -> None:
        """End the worker now (SIGKILL, or the engine's equivalent)."""

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the worker to end; its status, or None."""


class Launcher(Protocol):
    """Starts workers; closing it ends whatever it started that still runs."""

    def start(self, spec: WorkerSpec) -> WorkerHandle: ...

    def close(self) -> None: ...


class _Process:
    """A worker subprocess of this host."""

    def __init__(self, popen: subprocess.Popen[bytes]):
        self._popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalLauncher:
    """Workers as subprocesses of this process, on this host."""

    def __init__(self) -> None:
        self._started: list[_Process] = []

    def start(self, spec: WorkerSpec) -> WorkerHandle:
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        popen = subprocess.Popen([sys.executable, "-m", "pycomm.parallel.pathways.worker"], env=env)
        handle = _Process(popen)
        self._started.append(handle)
        return handle

    def close(self) -> None:
        for handle in self._started:
            handle.kill()
        for handle in self._started:
            handle.wait(10.0)
        self._started.clear()
