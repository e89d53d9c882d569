"""The job's rendezvous: a TCPStore whose port is bound once, by whoever holds it.

Picking a free port and handing it to ranks that bind it later is a race: between the
two, anything on the host may take the port (an outgoing connection's ephemeral port,
another job), and the job dies with EADDRINUSE (it did, once, in a 2-rank loaded table).
So a launcher hosts the store itself on port 0 (the kernel picks, and the socket keeps
it) and tells its ranks the port through ``BENCH_STORE_PORT``; a rank joins it as a
client (``job_store``). Ranks started by hand (torchrun, mpirun) with MASTER_PORT use
env:// as given; under a hand-typed mpirun without it, rank 0 hosts the store
(``host_for_process``) and MPI tells the others its port.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

HOST = "127.0.0.1"
PORT_VAR = "BENCH_STORE_PORT"  # set by a launcher that holds the job's TCPStore
TIMEOUT = datetime.timedelta(minutes=10)


def _master_store(world: int):
    """The job's TCPStore, served from this process on a port the kernel picks."""
    import torch.distributed as dist

    return dist.TCPStore(HOST, 0, world, is_master=True, timeout=TIMEOUT,
                         wait_for_workers=False)


@contextmanager
def hosted_store(world: int) -> Iterator[int]:
    """A TCPStore for ``world`` ranks, held here on a port the kernel picked; its port,
    also in ``BENCH_STORE_PORT`` for the ranks started inside the block, which inherit
    the environment. MASTER_ADDR and MASTER_PORT name it too: DeepSpeed's shm all-reduce
    names its segments after them (unique per job, as this port is while it is held)."""
    store = _master_store(world)
    try:
        with patch.dict(os.environ, {PORT_VAR: str(store.port), "MASTER_ADDR": HOST,
                                     "MASTER_PORT": str(store.port)}):
            yield store.port
    finally:
        del store


def job_store(world: int):
    """The launcher's store as a client (a rank's side of hosted_store), or None when no
    launcher hosts one (then init_process_group takes env:// as the user set it)."""
    port = os.environ.get(PORT_VAR)
    if not port:
        return None
    import torch.distributed as dist

    return dist.TCPStore(os.environ.get("MASTER_ADDR", HOST), int(port), world,
                         is_master=False, timeout=TIMEOUT)


def init_default_group(backend: str, rank: int, world: int) -> None:
    """init_process_group on the launcher's store when there is one, else env://."""
    import torch.distributed as dist

    store = job_store(world)
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)


_JOB_STORE = []  # the store this process hosts for a hand-typed mpirun (held to its end)


def host_for_process(world: int) -> int:
    """Host the job's store here, on a port the kernel picked, for this process's life
    (rank 0 of a hand-typed mpirun: the other ranks learn the port over MPI); its port."""
    store = _master_store(world)
    _JOB_STORE.append(store)
    return int(store.port)
