"""DeepSpeed's CPU shared-memory all-reduce as a benchmark peer (``ShareMemCommBuilder``).

Initialised as DeepSpeed's own launcher leaves a rank: ``DS_ACCELERATOR=cpu``,
``LOCAL_SIZE`` = ranks on this host, then ``deepspeed.comm.init_distributed`` on the
gloo default group the benchmark already made. That JIT-builds the shm extension
(cached in ~/.cache/torch_extensions; the first build takes ~1.5 min) and maps one
66 MiB ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per rank.
"""

import contextlib
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from bench._timing import Buffers
from pycomm.parallel._optional import install_command, require

INSTALL = install_command("deepspeed")  # pip install 'pycomm-collectives[deepspeed]' ...
SEGMENT = "/dev/shm/deepspeed_allreduce_buffer"  # + _{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}
# dtype -> the shm kernels' vector level it needs: fp32 uses AVX2 (1), the 16-bit
# kernels AVX-512BW (2). Other dtypes the op returns unreduced, without an error.
LEVELS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}
ISA = {1: "avx2", 2: "avx512bw"}
# Where launchers put the number of ranks on this host: DeepSpeed's, torchrun's, mpirun's.
LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
_ready = False  # the shm op is initialised once per process (DeepSpeed keeps it static)


def local_size(world: int) -> int:
    """Ranks on this host as the launcher says, else ``world`` (spawned ranks share one)."""
    for name in LOCAL_SIZE_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return world


def missing(world: int | None = None) -> str:
    """Why DeepSpeed's shm all-reduce cannot be a peer here, or ''.

    ``world`` defaults to ``WORLD_SIZE`` (or mpirun's) when the launcher set it.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return f"deepspeed is not installed ({INSTALL})"
    if world is None:
        env = os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE", "")
        world = int(env) if env.isdigit() else None
    if world is not None and local_size(world) != world:
        return (f"DeepSpeed's shm all-reduce needs every rank on one host; "
                f"{local_size(world)} of {world} ranks are on this one")
    return stale_build_lock()


# DeepSpeed JIT-builds its shm op through torch's extension loader, which takes a lock file
# in the build folder and waits, without bound, for whoever holds it. A build killed part
# way (a timed-out job) leaves the lock behind, and every later job then waits forever.
# A fresh build takes about a minute here; a lock far older than that is left over.
STALE_LOCK_S = 900.0


def stale_build_lock(now: float | None = None) -> str:
    """Why the shm op cannot be loaded (a lock left by a killed build), or ''."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory("deepspeed_shm_comm", verbose=False), "lock")
    try:
        age = (now if now is not None else time.time()) - os.path.getmtime(lock)
    except OSError:
        return ""
    if age < STALE_LOCK_S:
        return ""
    return (f"DeepSpeed's shm op build is locked by {lock}, {age / 60:.0f} min old: a build "
            "killed part way left it, and loading would wait for it forever; remove it")


def oversubscribed(world: int, cpus: int | None = None) -> str:
    """A note for the table when this host's ranks outnumber the CPUs they may use, else ''.

    The shm op waits by spinning on its peers' state flags, never yielding; with more
    ranks than CPUs a wait lasts until the scheduler preempts the spinner (a time
    slice, milliseconds). It still finishes: 4 ranks on 2 CPUs, and on 1, were measured.
    """
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    ranks = local_size(world)
    if ranks <= cpus:
        return ""
    return (f"{ranks} ranks on {cpus} CPUs: DeepSpeed's shm all-reduce spins while it waits, "
            "so each wait can last a scheduler time slice")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send fd 1 (Python prints, the JIT build's compiler, C printf) to stderr, so rank
    0's table stays the only thing on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _quiet_logger() -> None:
    """DeepSpeed's logger writes to the stdout it saw at import: point it at stderr."""
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _segment(rank: int) -> str:
    """This job's shm segment of ``rank``, named as DeepSpeed's shm_initialize names it."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{SEGMENT}_{os.getuid()}_{addr}_{port}_{rank}"


def _init_shm(rank: int, world: int) -> int:
    """Collective: DeepSpeed's init on the default group; the shm kernels' vector level."""
    global _ready
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) != 1:
        raise RuntimeError(f"DeepSpeed's shm all-reduce needs one host; ranks are on {set(hosts)}")
    if not os.environ.get("MASTER_PORT"):
        # DeepSpeed names its segments after MASTER_ADDR/MASTER_PORT: without them, two
        # jobs on this host would map each other's.
        raise RuntimeError("DeepSpeed's shm all-reduce needs MASTER_ADDR/MASTER_PORT set")
    os.environ["DS_ACCELERATOR"] = "cpu"
    # The shm kernels reduce in OpenMP loops, on the OpenMP runtime the op links, which
    # is not torch's (torch.set_num_threads does not reach it): left alone it starts a
    # thread per CPU, and pinned ranks then share their one CPU with spinning threads.
    # DeepSpeed's launcher sets OMP_NUM_THREADS to the cores per rank; one per rank here,
    # as the benchmark gives every backend.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads())))
    # Without LOCAL_SIZE == world, shm_initialize maps nothing and the op segfaults.
    os.environ["LOCAL_SIZE"] = str(world)
    mine = _segment(rank)
    if not _ready:
        # A segment left by an earlier job on this port would be reused with stale
        # state flags: each rank removes its own, and none maps a peer's before then.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)
        dist.barrier()
    with _stdout_to_stderr():
        ds_comm = require("deepspeed.comm", "bench's deepspeed peer")
        get_accelerator = require("deepspeed.accelerator", "bench's deepspeed peer").get_accelerator
        _quiet_logger()
        if get_accelerator().device_name() != "cpu":
            raise RuntimeError(f"DeepSpeed chose accelerator {get_accelerator().device_name()!r}, "
                               "not 'cpu' (it was imported before DS_ACCELERATOR=cpu was set)")
        ds_comm.init_distributed(dist_backend="gloo")
    cdb = ds_comm.comm.cdb
    if getattr(cdb, "shm_comm_op", None) is None:
        raise RuntimeError("DeepSpeed did not build its ShareMemCommBuilder op on this machine")
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        raise RuntimeError("torch.ops.deepspeed.inference_all_reduce_ is not registered")
    if not _ready:
        if not os.path.exists(mine):
            raise RuntimeError(f"DeepSpeed's shm op was initialised without its segment {mine} "
                               "(LOCAL_SIZE unset at its first init?); its all-reduce would crash")
        # Every rank has mapped every segment once all are past init: unlink ours now,
        # so the 66 MiB per rank go when the job ends, however it ends.
        dist.barrier()
        os.unlink(mine)
        _ready = True
    return int(getattr(cdb, "shm_vector_kernel_level", 0))


class DeepSpeedComm:
    """DeepSpeed's shm all-reduce (``torch.ops.deepspeed.inference_all_reduce_``) as the
    timing loop sees it: the same API as TorchComm and MpiComm.

    Construct it on every rank after torch.distributed's (gloo) default group exists;
    it raises RuntimeError with the reason when DeepSpeed's shm path cannot run here.
    ``group`` other than the world group is accepted but reported unsupported: the op
    always spans every rank of the job.
    """

    alloc = staticmethod(torch.empty)

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedComm needs torch.distributed's default group first")
        if why := missing(dist.get_world_size()):
            raise RuntimeError(why)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.level = _init_shm(self.rank, self.world)
        self._token = torch.zeros(1)  # float32: every vector level has its kernel
        size = self.world if group is None else dist.get_world_size(group)
        self.not_world = (
            "" if size == self.world else
            f"DeepSpeed's shm all-reduce spans every rank of the job, not a group of {size}"
        )

    def barrier(self) -> None:
        # The shm op has no barrier of its own, but an all-reduce of one element is one:
        # no rank leaves it before every rank has arrived. It aligns the ranks as tightly
        # as the op itself can, as every other backend's own barrier does; a gloo
        # barrier would release them tens of microseconds apart and charge that skew
        # to DeepSpeed's next call.
        torch.ops.deepspeed.inference_all_reduce_(self._token)

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        """Why this case cannot run on DeepSpeed's shm all-reduce ('' = it can)."""
        if self.not_world:
            return self.not_world
        if op != "all_reduce":
            return "DeepSpeed's shm path has all_reduce only (inference_all_reduce)"
        if redop != "sum":
            return f"DeepSpeed's shm all-reduce sums only (it ignores op={redop})"
        if dtype not in LEVELS:
            return (f"DeepSpeed's shm all-reduce has no {dtype} kernel "
                    "(float32, bfloat16, float16; others come back unreduced)")
        if self.level < LEVELS[dtype]:
            isa = ISA[LEVELS[dtype]]
            return f"DeepSpeed's shm {dtype} kernel needs {isa}, which this CPU lacks"
        return ""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        """The raw op on the in-place buffer, as deepspeed.comm calls it when it can."""
        kernel, tensor = torch.ops.deepspeed.inference_all_reduce_, bufs.work
        return lambda: kernel(tensor)


class DeepSpeedCommApi(DeepSpeedComm):
    """The same shm all-reduce through DeepSpeed's public ``deepspeed.comm.inference_all_reduce``
    (its ``timed_op`` wrapper, the world-size and ISA checks, then the raw op)."""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        ds_comm = require("deepspeed.comm", "bench's deepspeed-api peer")
        call, tensor, red = ds_comm.inference_all_reduce, bufs.work, ds_comm.ReduceOp.SUM
        return lambda: call(tensor, red)
