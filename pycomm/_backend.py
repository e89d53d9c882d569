"""Registration of the ``pycomm`` backend with torch.distributed, and the extension.

``import pycomm`` loads the compiled extension ``pycomm._C`` and raises ImportError
(as ``import torch`` does without its own ``_C``) when it cannot be loaded: not built,
or built against another torch. The message says why, which torch is running and which
one the build was made for (when its installed metadata says), and how to fix it, for
a source checkout and for an installed copy alike. ``PYCOMM_ALLOW_NO_EXTENSION=1``
imports pycomm without it (``python -m pycomm.env``'s report, the tests on gloo):
creating a pycomm group then raises that message.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from pycomm import _install

BACKEND_NAME = "pycomm"
# Set to 1: ``import pycomm`` succeeds without a loadable extension (see the docstring).
ALLOW_NO_EXTENSION = "PYCOMM_ALLOW_NO_EXTENSION"


def extension_error() -> str | None:
    """Why ``pycomm._C`` cannot be loaded, or None when it can."""
    try:
        _extension()
    except RuntimeError as exc:
        return str(exc)
    return None


def load_failure(exc: BaseException) -> str:
    """What to tell the user when ``pycomm._C`` does not import: ``exc``, the torch running
    and the one the build was made for, and the fix for this copy of pycomm."""
    running = str(torch.__version__)
    built = _install.built_against()
    lines = [f"pycomm: the C++ extension pycomm._C cannot be loaded: {exc}",
             f"torch {running} is running; pycomm was built against "
             + (f"torch {built} (its installed metadata's requirement)." if built else
                "a torch that is not recorded (no installed metadata of this copy pins one).")]
    root = _install.checkout_root()
    if root is not None:
        lines += [f"This pycomm is a source checkout ({root}): build the extension against "
                  "the running torch, from the checkout's root:",
                  f"    cd {root} && pip install --no-build-isolation -e ."]
    else:
        lines += [f"This pycomm is an installed copy ({_install.PACKAGE_DIR}): reinstall it "
                  "so that it compiles against the running torch:",
                  "    pip install --no-build-isolation --force-reinstall --no-deps "
                  "--no-binary pycomm pycomm"]
    if built and built != running.partition("+")[0]:
        lines.append(f"or run the torch it was built against: pip install torch=={built}")
    return "\n".join(lines)


def _extension() -> ModuleType:
    try:
        # import_module, not `from pycomm import _C`: during ``import pycomm`` that would
        # say "partially initialized module" instead of what is wrong.
        return importlib.import_module("pycomm._C")
    except ImportError as exc:
        raise RuntimeError(load_failure(exc)) from exc


def check_extension() -> None:
    """What ``import pycomm`` runs: ImportError, chained from the original one, when the
    extension does not load (unless PYCOMM_ALLOW_NO_EXTENSION=1)."""
    if os.environ.get(ALLOW_NO_EXTENSION) == "1":
        return
    try:
        _extension()
    except RuntimeError as exc:
        raise ImportError(f"{exc}\n({ALLOW_NO_EXTENSION}=1 imports pycomm without it, "
                          "e.g. for python -m pycomm.env's report.)",
                          name="pycomm._C") from exc.__cause__


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
    from pycomm import _startup, islands, ops

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
