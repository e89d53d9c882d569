"""How the benchmark's ranks come to be: mpirun, torchrun, or spawned here.

- Started by mpirun (OMPI_COMM_WORLD_RANK set): this process is a rank.
- Started by torchrun (RANK and WORLD_SIZE set): this process is a rank; mpi is skipped.
- Otherwise, when mpi is requested and Open MPI is installed, the same command is
  re-executed under mpirun (one job holds every backend); else ``--nproc`` ranks are
  spawned with torch.multiprocessing.
"""

import argparse
import os
from collections.abc import Callable

from bench import _mpi
from bench._ports import hosted_store

Worker = Callable[[int, int, argparse.Namespace], None]


def wants_mpi(backends: list[str]) -> bool:
    return any(b.split("#")[0] == "mpi" for b in backends)


def launch(argv: list[str], args: argparse.Namespace, worker: Worker,
           module: str = "bench.collectives") -> None:
    """Run ``worker(rank, world, args)`` on every rank, starting the ranks if need be
    (under mpirun: ``python -m module argv``)."""
    if (mpi_world := _mpi.world_from_env()) is not None:
        _mpi.ensure_rendezvous()
        worker(*mpi_world, args)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    elif wants_mpi(args.backends) and not _mpi.missing():
        # The children parse the same argv, so they resolve the same backends.
        rc = _mpi.reexec(argv, args.nproc, args.mpirun_args, module)
        if rc:
            raise SystemExit(rc)
    else:
        _spawn(worker, args)


def _spawn(worker: Worker, args: argparse.Namespace) -> None:
    """``--nproc`` local ranks through torch.multiprocessing, sharing a fresh rendezvous."""
    import torch.multiprocessing as mp

    with hosted_store(args.nproc):  # the spawned ranks inherit its port from the environment
        mp.spawn(_rank, args=(worker, args.nproc, args), nprocs=args.nproc, join=True)


def _rank(rank: int, worker: Worker, world: int, args: argparse.Namespace) -> None:
    """mp.spawn's entry: its index first, then our arguments."""
    worker(rank, world, args)


def bind_rank(rank: int, world: int, mode: str) -> int | None:
    """Pin this rank to one CPU per ``--bind``; returns the CPU, or None when left to float.

    Unpinned, the scheduler sometimes runs both ranks of a 2-rank job on one CPU for a
    while, and every small op then costs two context switches (see bench/README.md).
    The local rank picks the CPU: LOCAL_RANK (torchrun), Open MPI's local rank, or the
    rank itself."""
    cpus = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
    local_world = int(
        os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    )
    if mode == "none" or (mode == "auto" and local_world > len(cpus)):
        return None
    cpu = cpus[local % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu
