"""Where a worker's start-up meets the cluster's, in the cluster's store.

Two keys per island epoch:

- **launched**: the cluster sets it once it has started every worker it is starting
  (all islands at first, one island at a restart). A worker waits for it before its
  first wait on a peer, so that every start-up wait (the island's rendezvous, the links
  to the other islands) counts from the moment all its peers exist, as the cluster's own
  wait does. Without it, a worker launched first waits out its timeout while a slow
  launcher (Ray, on loaded CPUs) is still starting the last island.
- **failed**: a worker whose start-up raised leaves its cause here before it exits, so
  that the cluster's error names it whatever launcher ran the worker (Ray keeps a
  worker's output in its own logs).
"""

from __future__ import annotations

import contextlib
import datetime
import traceback

import torch.distributed as dist

CAUSE_CHARS = 2000  # the end of a traceback: its innermost frames and the error


def _launched_key(island: int, epoch: int) -> str:
    return f"pw/launched/{island}e{epoch}"


def _failed_key(island: int, rank: int, epoch: int) -> str:
    return f"pw/failed/{island}.{rank}e{epoch}"


def mark_launched(store: dist.Store, island: int, epoch: int) -> None:
    """Every worker of ``island`` (at ``epoch``) has been started."""
    store.set(_launched_key(island, epoch), "1")


def wait_launched(store: dist.Store, island: int, epoch: int, every_s: float) -> None:
    """Wait until the cluster has started every worker of this island's epoch.

    No bound but the cluster's life: launching takes what the launcher takes, and a
    cluster that gives up kills its workers; one that dies takes its store with it, and
    the wait then raises (``DistNetworkError``). ``every_s`` only paces the re-asks.
    """
    key = _launched_key(island, epoch)
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=every_s))
            return
        except dist.DistStoreError:  # not yet: the store answered, the key is not there
            continue


def leave_cause(store: dist.Store, island: int, rank: int, epoch: int,
                error: BaseException) -> None:
    """Record why this worker's start-up failed (best effort: the store may be gone)."""
    text = "".join(traceback.format_exception(error))[-CAUSE_CHARS:]
    with contextlib.suppress(dist.DistError):
        store.set(_failed_key(island, rank, epoch), text)


def read_cause(store: dist.Store, island: int, rank: int, epoch: int) -> str | None:
    """What a worker that failed its start-up left (None: nothing, e.g. it was killed)."""
    key = _failed_key(island, rank, epoch)
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode(errors="replace")
