"""A command run under a memory cap: a cgroup v1 memory controller's ``memory.limit_in_bytes``
(needs root), and what the cgroup saw: peak usage, failures to charge, OOM kills.

The cgroup's path is in the child's environment (``PYCOMM_MEMCAP_CGROUP``); each rank
joins it with :func:`join` once torch and the project are imported, before it builds its
model. Memory is charged to the cgroup of the task that touches it first, so the cap
bounds what training takes (model, optimizer state, buffers, page cache, shared memory),
not the ~200 MB of the torch runtime itself, which no model size changes. The result
says how many processes joined.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

ROOT = "/sys/fs/cgroup/memory"
NO_CGROUP = "no permission: cgroup v1 memory controller not writable"
ENV = "PYCOMM_MEMCAP_CGROUP"


def join() -> bool:
    """Move this process into the cgroup its launcher made (if any); True if it did."""
    group = os.environ.get(ENV)
    if not group:
        return False
    _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
    with open(os.environ[ENV + "_JOINED"], "a") as f:  # no plain file fits in a cgroup
        f.write(f"{os.getpid()}\n")
    return True


def available() -> str:
    """"" where a memory cgroup can be made here, else why not (a skip reason)."""
    probe = os.path.join(ROOT, f"pycomm_probe_{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return NO_CGROUP
    return ""


@dataclass
class Capped:
    """How a capped command ended."""

    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    max_usage_bytes: int
    failcnt: int
    oom_kills: int
    wall_s: float
    joined: int  # processes that joined the cgroup
    # the most anonymous + shared memory seen (sampled every 0.2 s): what the processes
    # hold, without the page cache of files they read or wrote, which the kernel takes
    # back under the cap (so max_usage_bytes reaches the cap whenever files are written)
    peak_held_bytes: int = 0

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0

    def summary(self) -> dict[str, Any]:
        return {"returncode": self.returncode, "max_usage_bytes": self.max_usage_bytes,
                "failcnt": self.failcnt, "oom_kills": self.oom_kills, "wall_s": self.wall_s,
                "joined": self.joined, "peak_held_bytes": self.peak_held_bytes}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _oom_kills(group: str) -> int:
    for line in _read(os.path.join(group, "memory.oom_control")).splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def run_capped(cmd: list[str], limit_bytes: int, timeout_s: float,
               env: dict[str, str] | None = None, cwd: str | None = None,
               whole_tree: bool = False) -> Capped:
    """Run ``cmd`` with a fresh memory cgroup limited to ``limit_bytes`` for its ranks to
    :func:`join` (``whole_tree``: ``cmd`` itself is in it from its start, so every
    process it starts is, a launcher included); the cgroup is removed after (any
    process of it still alive is killed first)."""
    group = os.path.join(ROOT, f"pycomm_offload_{os.getpid()}_{time.monotonic_ns()}")
    os.mkdir(group)
    try:
        _write(os.path.join(group, "memory.limit_in_bytes"), str(limit_bytes))
        joined = group.replace("/", "_") + ".joined"
        joined = os.path.join(tempfile.gettempdir(), joined)
        start = time.perf_counter()
        procs = os.path.join(group, "cgroup.procs")
        enter = (lambda: _write(procs, str(os.getpid()))) if whole_tree else None
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=cwd, env={**(env or os.environ), ENV: group,
                                                 ENV + "_JOINED": joined},
                                 preexec_fn=enter)
        held = _HeldSampler(group)
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
        wall = time.perf_counter() - start
        return Capped(child.returncode, out, err,
                      int(_read(os.path.join(group, "memory.max_usage_in_bytes"))),
                      int(_read(os.path.join(group, "memory.failcnt"))), _oom_kills(group), wall,
                      _count_lines(joined), held.stop())
    finally:
        _remove(group)


class _HeldSampler:
    """The cgroup's anonymous + shared memory (``total_rss + total_shmem`` of
    ``memory.stat``), its maximum sampled on a thread until :meth:`stop`."""

    def __init__(self, group: str, every_s: float = 0.2):
        self._stat, self._every = os.path.join(group, "memory.stat"), every_s
        self._done, self.peak = threading.Event(), 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            with contextlib.suppress(OSError, ValueError):
                stat = dict(line.split() for line in _read(self._stat).splitlines())
                self.peak = max(self.peak, int(stat["total_rss"]) + int(stat["total_shmem"]))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    count = len(_read(path).split())
    os.unlink(path)
    return count


def _remove(group: str) -> None:
    """Kill what is left in ``group`` (only processes this run started are in it), then
    remove it."""
    for _ in range(50):
        pids = [int(p) for p in _read(os.path.join(group, "cgroup.procs")).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    os.rmdir(group)
