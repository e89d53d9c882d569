"""Registration of the ``pycomm`` backend with torch.distributed: the function torch
calls for every pycomm group (``_create_backend``), its timeout and store prefix, and
the drain of every group's worker at interpreter exit. Loading the extension is
``pycomm._extension``'s.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from pycomm import _startup, islands, ops
from pycomm._extension import load as _extension

BACKEND_NAME = "pycomm"


def _timeout_seconds(timeout: datetime.timedelta | float | None) -> float:
    """The group's timeout: the one given to init_process_group / new_group.

    torch passes its default (30 min) when the user gave none; PYCOMM_TIMEOUT_S then
    replaces that default, so a job can shorten every group's timeout from outside.
    """
    env = os.environ.get("PYCOMM_TIMEOUT_S")
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif timeout is None:
        seconds = dist.default_pg_timeout.total_seconds()
    else:
        seconds = float(timeout)
    if env and seconds == dist.default_pg_timeout.total_seconds():
        try:
            seconds = float(env)
        except ValueError as e:
            raise ValueError(f"pycomm: PYCOMM_TIMEOUT_S={env!r} is not a number of seconds") from e
    if seconds <= 0:
        raise ValueError(f"pycomm: the timeout must be positive, got {seconds} s")
    return seconds


def incarnation_store(store: dist.Store, group_rank: int, group_size: int) -> dist.Store:
    """The part of ``store`` that belongs to this incarnation of the group.

    torch names groups by a counter it restarts at ``destroy_process_group()``, so a
    group created again over the same store gets the same key prefix, where the last
    incarnation's keys (segment names, error records) still lie. Every rank counts the
    incarnations in the store itself, by its place in the group (size and rank): each
    incarnation fills every place once, so all members count alike and meet under a
    fresh prefix, even when a group of that name had other members or sizes before.
    """
    generation = store.add(f"pycomm/incarnation/{group_size}/{group_rank}", 1)
    return dist.PrefixStore(f"pycomm/{generation}/", store)


def _create_backend(
    store: dist.Store, group_rank: int, group_size: int, timeout: datetime.timedelta
) -> Any:
    """Called by torch for every process group created with backend "pycomm".

    Ranks on one host (one island) get the shared-memory backend itself; a group
    spanning islands gets ProcessGroupIslands (see pycomm/islands.py).
    """
    _drain_at_exit_once()
    store = incarnation_store(store, group_rank, group_size)
    _startup.announce(store, group_rank)
    try:
        seconds = _timeout_seconds(timeout)
        ext = _extension()
        ops.load()  # torch.ops.pycomm.* usable (and traceable) once a group exists
        ids = islands.island_ids(store, group_rank, group_size)
        islands.log_choice(group_rank, group_size, ids)
    except BaseException as exc:  # the other ranks must not wait for this one
        _startup.report_failure(store, group_rank, exc)
        raise
    if max(ids) == 0:
        return ext.ProcessGroupPycomm(store, group_rank, group_size, seconds)
    return islands.create(store, group_rank, group_size, seconds, ids, ext)


_EXIT_DRAIN_CAP_S = 30.0
_exit_hook_installed = False


def _drain_at_exit_once() -> None:
    """At interpreter exit, first let every group's worker finish what it runs: an op's
    completion runs its future's callbacks, and a Python callback still running when the
    interpreter finalizes aborts the process. Bounded by each group's timeout, 30 s at
    most (a stuck callback is cut off by the stall watch's failure meanwhile)."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    atexit.register(lambda: _extension()._wait_workers_idle(_EXIT_DRAIN_CAP_S))


def register() -> None:
    """Registers "pycomm" for CPU tensors, and CUDA ones under a CUDA torch (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # With a CUDA build of torch the group takes CUDA tensors too: a CUDA build of
    # pycomm._C runs them on its CUDA-IPC ring, a CPU-only one refuses them by name.
    devices = ["cpu", "cuda"] if torch.version.cuda else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=devices)
