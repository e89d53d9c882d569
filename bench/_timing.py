"""Rank-side timing of one collective, at one size, on one process group.

Inputs are k/8 for random integers |k| <= 8: exact in every float dtype, so
sums over up to 31 ranks are exact in any order and a correct backend matches
the float64 reference bit for bit (``#wrong`` counts the elements that do not).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
IN_PLACE = ("all_reduce", "broadcast", "reduce")  # as DDP and torch's API use them
REDOPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
ROOT = 0  # broadcast and reduce root
# torch 2.9 and 2.10 know these two collectives only by their older names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
Alloc = Callable[..., torch.Tensor]  # (count, dtype=...) -> tensor: torch.empty, pycomm.empty


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link must carry, per byte of S."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("broadcast", "reduce"):
        return 1.0
    return (world - 1) / world


def busbw_gbs(op: str, nbytes: int, time_us: float, world: int) -> float:
    """nccl-tests' busbw in GB/s (1e9) of an op of ``nbytes`` that took ``time_us``."""
    return nbytes / (time_us * 1e-6) / 1e9 * busbw_factor(op, world)


def total_count(op: str, nbytes: int, elsize: int, world: int) -> int:
    """Elements of S for a sweep size: rounded down so every rank's share is whole."""
    count = nbytes // elsize
    return count if op in IN_PLACE else count - count % world


def rank_input(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's pristine input of ``count`` elements (see the module docstring)."""
    gen = torch.Generator().manual_seed(1_000_003 * count + rank)
    k = torch.randint(-8, 9, (count,), generator=gen)
    return k.to(dtype) / 8 if dtype.is_floating_point else k.to(dtype)


@dataclass
class Buffers:
    """One case's tensors: ``src`` is never touched, ``work`` is the op's input."""

    src: torch.Tensor
    work: torch.Tensor
    out: torch.Tensor | None

    def reset(self) -> None:
        """Restore the in-place ops' buffer, so every iteration reduces pristine data."""
        if self.out is None:
            self.work.copy_(self.src)

    def result(self) -> torch.Tensor:
        return self.work if self.out is None else self.out

    def poison(self) -> None:
        """Fill an out-of-place output with a value no correct result holds (NaN, or
        the dtype's minimum for integers), so that one left unwritten counts as wrong."""
        if self.out is not None:
            fill = float("nan") if self.out.is_floating_point() else torch.iinfo(self.out.dtype).min
            self.out.fill_(fill)


def make_buffers(
    op: str, count: int, dtype: torch.dtype, rank: int, world: int, alloc: Alloc = torch.empty
) -> Buffers:
    """Allocate a case with ``alloc`` (torch.empty, or pycomm.empty for arena buffers).

    ``count`` is S in elements (nccl-tests' S: docs/benchmarks.md). ``work`` is always a fresh
    allocation, so a backend that is faster on its own memory gets it for every op.
    """
    in_count = count // world if op == "all_gather" else count
    src = rank_input(rank, in_count, dtype)
    work = alloc(in_count, dtype=dtype)
    work.copy_(src)
    if op in IN_PLACE:
        return Buffers(src, work, None)
    out_count = count // world if op == "reduce_scatter" else count
    return Buffers(src, work, alloc(out_count, dtype=dtype))


class TorchComm:
    """A torch.distributed group as the timing loop sees it (mpi has its own: bench._mpi)."""

    def __init__(self, group, alloc: Alloc = torch.empty):
        self.group = group
        self.alloc = alloc
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        """Why this case cannot run here ('' = it can); torch backends raise their own."""
        return ""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        """A no-argument call that runs the collective once, synchronously."""
        red, group = REDOPS[redop], self.group
        calls = {
            "all_reduce": lambda: dist.all_reduce(bufs.work, op=red, group=group),
            "all_gather": lambda: _all_gather(bufs.out, bufs.work, group=group),
            "reduce_scatter": lambda: _reduce_scatter(
                bufs.out, bufs.work, op=red, group=group
            ),
            "broadcast": lambda: dist.broadcast(bufs.work, group_src=ROOT, group=group),
            "reduce": lambda: dist.reduce(bufs.work, group_dst=ROOT, op=red, group=group),
            "all_to_all": lambda: dist.all_to_all_single(bufs.out, bufs.work, group=group),
        }
        return calls[op]


class NativeComm(TorchComm):
    """pycomm called directly (``all_reduce_now``), not through torch.distributed's
    dispatcher: what mpi4py is to MPI, so small-message latency compares library with
    library. all_reduce only; the other ops are reported as unsupported."""

    def __init__(self, group):
        super().__init__(group)
        self.backend = group._get_backend(torch.device("cpu"))

    def barrier(self) -> None:
        self.backend.barrier_now()

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        return "" if op == "all_reduce" else "the native path has all_reduce only"

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        backend, tensor = self.backend, bufs.work
        return lambda: backend.all_reduce_now(tensor, redop)


class ApiComm(NativeComm):
    """pycomm through ``pycomm.all_reduce_``, the function a trainer calls: in eager mode
    the backend's native entry (no dispatcher, no Work), the operator under
    torch.compile. all_reduce only."""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        import pycomm

        call, tensor, group = pycomm.all_reduce_, bufs.work, self.group

        def run() -> None:
            call(tensor, redop, group)

        return run


class OpComm(NativeComm):
    """pycomm through ``torch.ops.pycomm.all_reduce_``: the torch operator (one
    dispatcher call, no Work), the fast path a trainer or a compiled graph takes."""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        call, tensor = torch.ops.pycomm.all_reduce_.default, bufs.work
        name = self.group.group_name
        return lambda: call(tensor, redop, name)


class FloorComm(TorchComm):
    """``dist.all_reduce`` on torch's FakeProcessGroup, which does nothing: torch's Python
    wrapper, ProcessGroup and dispatcher alone, timed the same way as every other column
    (a barrier of ``aligner``, a real group, before each call), so that a backend's cost over
    torch's floor is read per size and per job. all_reduce only; never checked (it
    computes nothing)."""

    checked = False

    def __init__(self, aligner):
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")

        super().__init__(dist.new_group(backend="fake"))
        self.aligner = aligner  # the group whose barrier precedes each call

    def barrier(self) -> None:
        # The fake group's barrier aligns nothing; a real one leaves the caches as the
        # compared backend's own barrier does (a gloo barrier costs milliseconds and
        # leaves them cold).
        dist.barrier(group=self.aligner)

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        return "" if op == "all_reduce" else "the floor is timed for all_reduce only"


def expected(
    op: str, count: int, dtype: torch.dtype, rank: int, world: int, redop: str
) -> torch.Tensor:
    """This rank's correct result in float64, rebuilt from every rank's input."""
    in_count = count // world if op == "all_gather" else count
    inputs = [rank_input(r, in_count, dtype).double() for r in range(world)]
    chunk = count // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    if op == "broadcast":
        return inputs[ROOT]
    if op == "all_gather":
        return torch.cat(inputs)
    if op == "all_to_all":
        return torch.cat([x[mine] for x in inputs])
    stacked = torch.stack(inputs)
    reduced = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "max": stacked.amax(0),
        "min": stacked.amin(0),
    }[redop]
    return reduced[mine] if op == "reduce_scatter" else reduced


def count_wrong(result: torch.Tensor, ref: torch.Tensor, redop: str) -> int:
    """Elements off the reference: exact, except avg's one rounding of the division."""
    tol = torch.finfo(result.dtype).eps if redop == "avg" and result.is_floating_point() else 0
    err = (result.double() - ref).abs()
    return int((~(err <= tol * ref.abs().clamp(min=1))).sum())  # NaN counts as wrong


def time_case(op: str, count: int, dtype: torch.dtype, comm, args) -> dict:
    """Time ``args.iters`` runs after ``args.warmup_iters``; this rank's seconds and #wrong.

    ``comm`` is a :class:`TorchComm`, ``bench._mpi.MpiComm`` or a DeepSpeed comm.
    ``args.timing`` picks how (both as nccl-tests reads them):

    - "barrier": a barrier of the backend under test precedes every iteration, so each
      starts from aligned ranks; rank 0 later takes the slowest rank per iteration.
    - "b2b": one barrier, then the iterations back to back, timed as a block (the
      nccl-tests way: a rank's next call may overlap its peers' last one); every
      iteration's time is the block's mean.

    ``#wrong`` (with ``args.check``): 1 counts it on one iteration's result (the last
    timed one; in b2b mode an extra untimed one, as the timed ones reduce their own
    outputs again), 2 on every iteration (barrier mode), with out-of-place outputs
    poisoned before each counted call so that a call that writes nothing cannot pass
    (the inputs are the same every iteration: an earlier call's output would).
    """
    bufs = make_buffers(op, count, dtype, comm.rank, comm.world, comm.alloc)
    run = comm.launcher(op, bufs, args.redop)
    checker = _Checker(op, count, dtype, comm, args)
    if getattr(args, "timing", "barrier") == "b2b":
        times = _back_to_back(bufs, run, comm, args)
        checker.check(bufs, run, comm)
    else:
        times = []
        last = args.warmup_iters + args.iters - 1
        for i in range(last + 1):
            counted = i >= args.warmup_iters and (checker.every or i == last)
            bufs.reset()
            if counted:  # the inputs are the same every time: an output the counted
                bufs.poison()  # call left unwritten would still hold the last call's result
            comm.barrier()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if i >= args.warmup_iters:
                times.append(elapsed)
                if counted:
                    checker.count(bufs)
    return {"times": times, "wrong": checker.wrong}


def _back_to_back(bufs: Buffers, run: Callable[[], None], comm, args) -> list[float]:
    """Warm-up, one barrier, then ``args.iters`` calls timed as one block."""
    for _ in range(args.warmup_iters):
        bufs.reset()
        run()
    bufs.reset()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        run()
    per_call = (time.perf_counter() - start) / max(1, args.iters)
    return [per_call] * args.iters


class _Checker:
    """Counts wrong elements against the float64 reference (see :func:`time_case`)."""

    def __init__(self, op: str, count: int, dtype: torch.dtype, comm, args):
        self.enabled = bool(args.check) and getattr(comm, "checked", True)
        self.every = args.check >= 2
        self.skip = op == "reduce" and comm.rank != ROOT  # only the root holds a result
        self.ref = (expected(op, count, dtype, comm.rank, comm.world, args.redop)
                    if self.enabled and not self.skip else None)
        self.redop = args.redop
        self.wrong = -1 if not self.enabled else 0

    def count(self, bufs: Buffers) -> None:
        if self.ref is not None:
            self.wrong += count_wrong(bufs.result(), self.ref, self.redop)

    def check(self, bufs: Buffers, run: Callable[[], None], comm) -> None:
        """One untimed call on pristine inputs, counted (b2b mode)."""
        if not self.enabled:
            return
        bufs.reset()
        bufs.poison()
        comm.barrier()
        run()
        self.count(bufs)


def time_dispatch_floor(group_world, calls: int = 20000) -> float | None:
    """Microseconds per ``dist.all_reduce`` of two floats on a backend that does no work
    at all (torch's FakeProcessGroup): torch's Python wrapper, ProcessGroup and
    dispatcher, no communication. No backend reached through ``dist.all_reduce`` can be
    faster. Collective (every rank creates the group); rank 0 times it while the others
    sleep in a barrier, so oversubscription does not inflate it. None on other ranks, or
    when this torch has no fake backend."""
    try:
        import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
    except ImportError:
        return None
    fake = dist.new_group(backend="fake")
    floor = None
    if dist.get_rank() == 0:
        x = torch.ones(2)
        batch = max(1, calls // 7)
        for _ in range(batch):
            dist.all_reduce(x, group=fake)
        per_call = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(batch):
                dist.all_reduce(x, group=fake)
            per_call.append((time.perf_counter() - start) / batch * 1e6)
        floor = sorted(per_call)[3]
    dist.barrier(group=group_world)
    return floor
