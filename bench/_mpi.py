"""Open MPI as a benchmark peer: mpi4py collectives on the same buffers as torch's.

MPI ranks must be started by ``mpirun``, so the launcher re-executes the whole
benchmark under it (:func:`reexec`); pycomm and gloo then run as torch.distributed
groups in those same processes, and the three stay interleaved per size.
"""

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable

import torch

from bench import _ports
from bench._timing import REDUCING, ROOT, Buffers
from pycomm.parallel._optional import require

INSTALL = "apt-get install -y openmpi-bin libopenmpi-dev && pip install mpi4py"
# Besides PYCOMM_*: what every rank needs to behave as a spawned rank would.
FORWARD = ("MASTER_ADDR", "MASTER_PORT", _ports.PORT_VAR, "OMP_NUM_THREADS", "PYTHONPATH")
# Open MPI's own (lower-case) names of MCA settings its ranks see in the environment.
OVERSUBSCRIBED, YIELD = "OMPI_MCA_mpi_oversubscribe", "OMPI_MCA_mpi_yield_when_idle"


def missing() -> str:
    """Why Open MPI cannot be a peer on this machine (no mpi4py or no mpirun), or ''."""
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed (get Open MPI with: {INSTALL})"
    if shutil.which("mpirun") is None:
        return f"mpirun is not on PATH (get Open MPI with: {INSTALL})"
    return ""


def world_from_env() -> tuple[int, int] | None:
    """(rank, world) when this process was started by Open MPI's mpirun, else None."""
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return None
    return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])


def _mpi():
    """mpi4py's MPI module, initialised at most once, funneled (only this thread calls MPI)."""
    mpi4py = require("mpi4py", "bench's mpi peer (Open MPI through mpi4py)")
    # Open MPI's default here, MPI_THREAD_MULTIPLE, puts locks on every call; pycomm's
    # and gloo's threads never call MPI, so funneled is both correct and fair to MPI.
    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI

    return MPI


def ensure_rendezvous() -> None:
    """Under a hand-typed ``mpirun`` without MASTER_PORT: rank 0 hosts the job's store on
    a port the kernel picked (bench._ports: no port race), MPI tells the others."""
    if "MASTER_PORT" in os.environ or _ports.PORT_VAR in os.environ:
        return
    if missing():
        raise SystemExit(f"started by mpirun without MASTER_PORT and {missing()}")
    comm = _mpi().COMM_WORLD
    world = comm.Get_size()
    port = comm.bcast(_ports.host_for_process(world) if comm.Get_rank() == 0 else None, root=0)
    os.environ.update({_ports.PORT_VAR: str(port), "MASTER_ADDR": _ports.HOST,
                       "MASTER_PORT": str(port)})


def reexec(argv: list[str], nproc: int, extra: str, module: str = "bench.collectives") -> int:
    """Run this benchmark again under mpirun with ``nproc`` ranks; its exit status.

    ``--oversubscribe`` lets more ranks than cores start (Open MPI then makes idle
    ranks yield instead of spin); ``-x`` hands every rank the rendezvous the
    launcher holds (bench._ports) and the PYCOMM_* settings, as a spawned rank would inherit them.
    """
    with _ports.hosted_store(nproc):  # the ranks join it (bench._ports: no port race)
        env = dict(os.environ)
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc)]
        cmd += shlex.split(extra)
        for name in sorted(env):
            if name in FORWARD or name.startswith("PYCOMM_"):
                cmd += ["-x", name]
        cmd += [sys.executable, "-m", module, *argv]
        print("# re-executing under mpirun: " + shlex.join(cmd), file=sys.stderr, flush=True)
        return subprocess.run(cmd, env=env, check=False).returncode


def oversubscribed(world: int) -> str:
    """A note for the table when mpirun found more ranks than cores, else ''."""
    # mpirun tells its ranks (this variable) and then makes MPI yield the core while
    # it waits, unless the user set mpi_yield_when_idle themselves.
    if os.environ.get(OVERSUBSCRIBED) != "1":
        return ""
    yields = os.environ.get(YIELD, "1") not in ("0", "false")
    return f"{world} ranks oversubscribe the cores: Open MPI " + (
        "yields the core while it waits (mpi_yield_when_idle)" if yields else "spins while it waits"
    )


def _as_numpy(t: torch.Tensor):
    """A numpy view sharing ``t``'s memory; 2-byte floats as int16, which MPI can move."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy()
    return t.numpy()


class MpiComm:
    """MPI_COMM_WORLD (a duplicate) as the timing loop sees it: the same API as TorchComm."""

    alloc = staticmethod(torch.empty)

    def __init__(self):
        self.MPI = _mpi()
        self.comm = self.MPI.COMM_WORLD.Dup()
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        """Reductions MPI cannot do on this dtype ('' = it can)."""
        if op not in REDUCING:
            return ""
        if dtype in (torch.float16, torch.bfloat16):
            return f"Open MPI has no {dtype} reduction (it moves them as 2-byte ints)"
        if redop == "avg" and not dtype.is_floating_point:
            return "MPI has no AVG; the sum-then-divide stand-in needs a float dtype"
        return ""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        """One blocking mpi4py call on numpy views of the case's tensors.

        MPI has no AVG: the stand-in is SUM followed by a division, both timed,
        which is what an MPI program would do.
        """
        MPI, comm = self.MPI, self.comm
        red = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[redop]
        work = _as_numpy(bufs.work)
        out = None if bufs.out is None else _as_numpy(bufs.out)
        scale = self.world if redop == "avg" else 1
        calls = {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, work, op=red),
            "all_gather": lambda: comm.Allgather(work, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(work, out, op=red),
            "broadcast": lambda: comm.Bcast(work, root=ROOT),
            "reduce": lambda: comm.Reduce(
                MPI.IN_PLACE if self.rank == ROOT else work, work, op=red, root=ROOT
            ),
            "all_to_all": lambda: comm.Alltoall(work, out),
        }
        call = calls[op]
        if scale == 1:
            return call
        result = bufs.result()

        def sum_then_divide() -> None:
            call()
            result.div_(scale)

        return sum_then_divide
