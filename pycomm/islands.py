"""Islands: which ranks of a group share a host, and the backend for groups spanning hosts.

Ranks on one host form an island and talk over shared memory; between islands pycomm
uses torch's gloo backend (for CPU tensors), created here from the group's own store
and timeout. ``PYCOMM_LOCAL_SIZE=N`` makes every N consecutive (global) ranks an
island, which simulates a multi-host job on one machine.

Example (4 ranks, 2 simulated hosts)::

    PYCOMM_LOCAL_SIZE=2 torchrun --nproc-per-node 4 train.py   # init_process_group("pycomm")
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from pycomm import _log, _startup
from pycomm._install import version

_KEY = "pycomm/islands/host/"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_key() -> str:
    """What ranks that can share memory have in common.

    The host name, its boot, the /dev/shm mount and the network namespace: two
    containers (or two ``ip netns``) on one machine are separate islands, which costs at
    most some speed, while ranks that cannot open each other's segments never share one.
    """
    try:
        shm = os.stat("/dev/shm")
        shm_id = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        shm_id = ""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return "|".join((socket.gethostname(), boot, shm_id, netns))


def local_size_from_env() -> int | None:
    """``PYCOMM_LOCAL_SIZE`` as a positive int, or None when unset.

    Raises:
        ValueError: the variable is set but is not a positive integer.
    """
    env = os.environ.get("PYCOMM_LOCAL_SIZE", "").strip()
    if not env:
        return None
    try:
        size = int(env)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"pycomm: PYCOMM_LOCAL_SIZE={env!r} is not a positive number of ranks")
    return size


def island_ids(store: dist.Store, group_rank: int, group_size: int) -> list[int]:
    """Island index of every rank of the group (numbered by lowest rank), via the store.

    Collective: every rank of the group must call it. With ``PYCOMM_LOCAL_SIZE=N`` the
    host of a rank is its *global* rank // N, so a subgroup keeps its ranks' hosts.
    """
    local_size = local_size_from_env()
    if local_size is not None:
        global_rank = dist.get_rank() if dist.is_initialized() else group_rank
        key = f"simulated host {global_rank // local_size}"
    else:
        key = host_key()
    if group_size == 1:
        return [0]
    store.set(f"{_KEY}{group_rank}", f"{local_size or 'unset'}\n{key}")
    _startup.wait_for_keys(store, {r: f"{_KEY}{r}" for r in range(group_size)}, group_rank)
    posted = [v.decode().split("\n", 1)
              for v in store.multi_get([f"{_KEY}{r}" for r in range(group_size)])]
    _check_local_sizes_agree([size for size, _ in posted], group_rank)
    first: dict[str, int] = {}
    return [first.setdefault(k, len(first)) for _, k in posted]


def _check_local_sizes_agree(sizes: list[str], group_rank: int) -> None:
    """Every rank must see the same hosts: a PYCOMM_LOCAL_SIZE set differently on some
    ranks would split them into islands that disagree (and hang). Every rank reads every
    rank's value, so all raise together."""
    if len(set(sizes)) > 1:
        by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
        raise ValueError(f"pycomm: PYCOMM_LOCAL_SIZE must be the same on every rank of a group "
                         f"(rank {group_rank} sees {by_rank})")


def _members(ids: list[int]) -> list[list[int]]:
    islands: list[list[int]] = [[] for _ in range(max(ids) + 1)]
    for rank, island in enumerate(ids):
        islands[island].append(rank)
    return islands


def _gloo(store: dist.Store, name: str, rank: int, size: int,
          timeout: datetime.timedelta) -> Any:
    """An inter-island engine: torch's gloo backend on its own corner of the store."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pycomm/islands/{name}/", store), rank, size,
                                 timeout)


def create(store: dist.Store, rank: int, size: int, timeout_s: float, ids: list[int],
           extension: Any) -> Any:
    """The backend for a group spanning several islands (a C++ ProcessGroupIslands).

    Builds, in the same order on every rank: a gloo group of all ranks (send/recv,
    gather, scatter, all_to_all); with equal islands one gloo group per local rank j
    (local rank j of every island: the ranks holding shard j), else a gloo group of the
    island leaders; and the island's own shared-memory group.
    """
    islands = _members(ids)
    island = ids[rank]
    local_rank = islands[island].index(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    world = _gloo(store, "world", rank, size, timeout)
    even = len({len(m) for m in islands}) == 1
    shard = leaders = None
    if even:
        shard = _gloo(store, f"shard{local_rank}", island, len(islands), timeout)
        leaders = shard if local_rank == 0 else None
    elif local_rank == 0:
        leaders = _gloo(store, "leaders", island, len(islands), timeout)
    local = extension.ProcessGroupPycomm(dist.PrefixStore(f"pycomm/island{island}/", store),
                                         local_rank, len(islands[island]), timeout_s)
    return extension.ProcessGroupIslands(store, rank, size, timeout_s, ids, local, world, shard,
                                         leaders)


def log_choice(rank: int, size: int, ids: list[int]) -> None:
    """With PYCOMM_DEBUG=INFO, log (once per group and rank) the version and the islands."""
    if _log.enabled("INFO", "INIT"):
        _log.info("INIT", rank, f"init: pycomm {version()} on torch "
                                f"{torch.__version__}, group rank {rank} of {size}")
    if _log.enabled("INFO", "ISLANDS"):
        n = max(ids) + 1
        what = "one island: shared memory only" if n == 1 else (
            f"{n} islands {_members(ids)}: shared memory inside, gloo between")
        _log.info("ISLANDS", rank, f"islands: group of {size}: {what}")
