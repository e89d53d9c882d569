"""A group's start through the store: no rank waits out the store's timeout for a rank
that gave up or died before it joined.

Every rank posts its pid first (``announce``); a rank whose setup fails posts why
(``report_failure``); every wait for another rank's key (``wait_for_keys``, and the
C++ side's waits in csrc/core/communicator/group_segment.cc, which read the same keys)
watches for both, so all ranks fail together, naming the cause.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

FAILED_KEY = "pycomm-init/failed"


def _pid_key(rank: int) -> str:
    return f"pycomm-init/pid/{rank}"


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def announce(store: dist.Store, rank: int) -> None:
    """Posts this rank's pid and PID namespace, so peers can tell when it has died."""
    store.set(_pid_key(rank), f"{os.getpid()} {_pid_namespace()}")


def report_failure(store: dist.Store, rank: int, exc: BaseException) -> None:
    """Posts why this rank cannot build the group (never raises: the store may be gone)."""
    try:
        # The first failure stands: a rank that fails because another did keeps quiet.
        store.compare_set(FAILED_KEY, "", f"rank {rank} failed at init: "
                          f"{type(exc).__name__}: {exc}")
    except Exception:  # the others then time out, as they would have
        return


def _died(store: dist.Store, rank: int) -> str:
    key = _pid_key(rank)
    if not store.check([key]):
        return ""
    pid_s, _, ns_s = store.get(key).decode().partition(" ")
    ns = int(ns_s) if ns_s.isdigit() else 0
    if not pid_s.isdigit() or ns == 0 or ns != _pid_namespace():
        return ""  # another PID namespace: its pid means nothing here
    try:
        os.kill(int(pid_s), 0)
    except ProcessLookupError:
        return f"rank {rank} (pid {pid_s}) died before the group started"
    except PermissionError:
        return ""  # alive, as another user
    return f"rank {rank} (pid {pid_s}) died before the group started" if _zombie(pid_s) else ""


def _zombie(pid: str) -> bool:
    """Dead, but its parent has not collected it yet (it still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def wait_for_keys(store: dist.Store, keys: dict[int, str], rank: int) -> None:
    """Waits until every rank's key in ``keys`` (rank -> key) is set, the store's
    timeout at most; raises at once, naming it, when a rank posted a failure or died."""
    timeout: datetime.timedelta = store.timeout  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.0002
    missing = dict(keys)
    while True:
        missing = {r: k for r, k in missing.items() if not store.check([k])}
        if not missing:
            return
        why = store.get(FAILED_KEY).decode() if store.check([FAILED_KEY]) else ""
        for r in missing:
            why = why or _died(store, r)
        if why:
            raise RuntimeError(f"pycomm: rank {rank}: the group cannot start: {why}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"pycomm: rank {rank}: the group cannot start: rank(s) {sorted(missing)} did "
                f"not arrive within the store's timeout ({timeout.total_seconds():.0f} s)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
