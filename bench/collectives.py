"""Collective benchmark, nccl-tests style: pycomm, gloo and Open MPI side by side in one run.

``python -m bench.collectives`` starts ``--nproc`` local ranks itself (under mpirun
when mpi is a backend, see :mod:`bench._launch`); under ``torchrun`` or ``mpirun``
it runs in place. All ranks join one gloo default group (used only to collect
timings) plus one communicator per backend under test, and for each op and size
the backends run one after the other (interleaved, order alternating per size)
so that machine noise hits all of them.

Example::

    python -m bench.collectives -b 1K -e 64M -f 4 --ops all_reduce,all_gather -c 1
"""

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist

from bench import (
    _c2c,
    _deepspeed,
    _gloo,
    _limit,
    _mpi,
    _ports,
    _provenance,
    _report,
    _stripes,
)
from bench._cli import DTYPES, parse_args
from bench._launch import bind_rank, launch
from bench._timing import (
    ApiComm,
    FloorComm,
    NativeComm,
    OpComm,
    TorchComm,
    time_case,
    time_dispatch_floor,
    total_count,
)
from pycomm.parallel._optional import available, note

DEEPSPEED = ("deepspeed", "deepspeed-api")


def _registered_alloc():
    """pycomm.empty, or a SystemExit saying it is not there yet."""
    import pycomm

    empty = getattr(pycomm, "empty", None)
    if empty is None:
        raise SystemExit(
            "pycomm-registered (--registered) times pycomm on buffers from "
            "pycomm.empty(shape, dtype=...), the zero-copy tensors of pycomm's shared-memory "
            "arena; this pycomm has no pycomm.empty yet. Use --backends without it."
        )
    return empty


def _available(backend: str) -> str:
    """Why ``backend`` cannot be used here, or '' when it can."""
    if backend == "mpi":
        if _mpi.world_from_env() is None:
            return "not started by mpirun (launch without torchrun to re-execute under it)"
        return _mpi.missing()
    if backend in DEEPSPEED:
        return _deepspeed.missing(dist.get_world_size())
    if backend == "torch-floor":
        try:
            import torch.testing._internal.distributed.fake_pg  # noqa: F401
        except ImportError:
            return "this torch has no fake backend (torch.testing._internal.distributed.fake_pg)"
        return ""
    if backend in _gloo.VARIANTS:
        backend = "gloo"
    if backend.startswith("pycomm"):
        try:
            import pycomm  # noqa: F401  (registers the backend)
        except Exception as exc:  # not built, or built against another torch
            return f"import pycomm failed: {exc!r}"
        backend = "pycomm"
    if backend not in dist.Backend.backend_list:
        return f"backend {backend!r} is not registered"
    return ""


def _floor_aligner() -> str:
    """The backend whose barrier precedes each torch-floor call: pycomm's when it is
    there (the floor is read against pycomm's dist.all_reduce), else the world's."""
    return "pycomm" if not _available("pycomm") else dist.get_backend()


def _comm(backend: str):
    """The communicator the timing loop drives for one backend (a column)."""
    if backend == "mpi":
        return _mpi.MpiComm()
    if backend == "pycomm-registered":
        return TorchComm(dist.new_group(backend="pycomm"), alloc=_registered_alloc())
    if backend == "pycomm-native":
        return NativeComm(dist.new_group(backend="pycomm"))
    if backend == "pycomm-op":
        return OpComm(dist.new_group(backend="pycomm"))
    if backend == "pycomm-api":
        return ApiComm(dist.new_group(backend="pycomm"))
    if backend == "torch-floor":
        return FloorComm(dist.new_group(backend=_floor_aligner()))
    if backend in _gloo.VARIANTS:
        return _gloo.GlooComm(backend)
    if backend == "deepspeed":
        return _deepspeed.DeepSpeedComm()
    if backend == "deepspeed-api":
        return _deepspeed.DeepSpeedCommApi()
    return TorchComm(dist.new_group(backend=backend))


def make_groups(backends: list[str]) -> tuple[dict, dict]:
    """One communicator per backend usable on every rank, and {backend: why} for the others.

    Every rank creates them in the same order, as ``new_group`` and MPI's Dup require.
    """
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, [_available(b.split("#")[0]) for b in backends])
    groups, skipped = {}, {}
    for i, b in enumerate(backends):
        why = next((r[i] for r in reasons if r[i]), "")
        if why:
            skipped[b] = why
            continue
        try:
            with _stripes.group_settings(b.split("#")[0]):
                groups[b] = _comm(_stripes.split(b.split("#")[0])[0])
        except RuntimeError as e:  # a peer that cannot start here (DeepSpeed's shm op)
            skipped[b] = str(e)
    return groups, skipped


def close_groups(groups: dict) -> None:
    """Ends the communicators this job made itself (torch's groups end with
    destroy_process_group), before the interpreter exits and with nothing else holding
    them (the timing closures form cycles, hence the collection)."""
    for comm in groups.values():
        close = getattr(comm, "close", None)
        if close is not None:
            close()
    groups.clear()
    gc.collect()


def _progress(total: int, quiet: bool):
    """A tqdm bar on rank 0 when tqdm is installed and not --quiet, else None."""
    if quiet or dist.get_rank() != 0:
        return None
    tqdm = available("tqdm")
    if tqdm is None:
        return None
    return tqdm.tqdm(total=total, desc="bench", leave=False, file=sys.stderr)


def measure(args: argparse.Namespace, groups: dict) -> tuple[list[tuple], dict]:
    """Run every (op, size, backend) case: this rank's (key, result) pairs, and the
    cases a backend cannot run as {(backend, op): why}."""
    dtype, world = DTYPES[args.datatype], dist.get_world_size()
    bar = _progress(len(args.ops) * len(args.sizes) * len(groups), args.quiet)
    out, cannot = [], {}
    for op in args.ops:
        for i, nbytes in enumerate(args.sizes):
            count = total_count(op, nbytes, dtype.itemsize, world)
            order = list(groups) if i % 2 == 0 else list(groups)[::-1]
            for b in order:
                if why := groups[b].unsupported(op, dtype, args.redop):
                    cannot[(b, op)] = why
                else:
                    res = time_case(op, count, dtype, groups[b], args)
                    out.append(((op, b, count * dtype.itemsize, count), res))
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return out, cannot


def report(args: argparse.Namespace, backends: list[str], gathered: list, skipped: dict,
           cannot: dict, info: dict) -> int:
    """Rank 0: summarise every rank's timings, print the tables, write JSON and the plot.

    ``gathered[r]`` is rank r's (case results, local pass times per size, dispatch floor in
    µs or None, rank 0's one-core rates or None) as sent by :func:`worker`. Returns the
    number of wrong elements (all ranks, all cases): the exit status follows it, as
    nccl-tests' does.
    """
    world = len(gathered)
    rows = [
        _report.summarize(*key, args.datatype, args.redop, [g[0][k][1] for g in gathered], world)
        for k, (key, _) in enumerate(gathered[0][0])
    ]
    local = {n: _limit.local_gbs(n, [g[1][n] for g in gathered]) for n in gathered[0][1]}
    cache = local[_limit.MIN_TIMED_BYTES]
    handoff = _limit.best_handoff([info.get("c2c_before"), info.get("c2c_after")])
    per_core = _limit.ranks_per_core(world, len(info.get("cpus", [])))
    one_core = gathered[0][3] or {}
    limits = {op: {r["bytes"]: _limit.limit_busbw(op, r["bytes"], world, local[size], cache,
                                                   handoff, per_core,
                                                   one_core_gbs=one_core.get(size))
                   for r, size in _rows_with_sweep_size(rows, op, args.sizes)}
              for op in args.ops}
    for line in _provenance.header_lines(info):
        print(line)
    print(f"# c2c before: {_c2c.describe(info['c2c_before'])}")
    print(f"# c2c after:  {_c2c.describe(info['c2c_after'])}")
    notes = [*args.notes, _mpi.oversubscribed(world) if "mpi" in backends else "",
             _deepspeed.oversubscribed(world, len(info.get("cpus", [])) or None)
             if set(DEEPSPEED) & set(backends) else ""]
    for line in filter(None, notes):
        print(f"# note: {line}")
    for b, why in skipped.items():
        print(f"# skipped {b}: {why}")
    for (b, op), why in cannot.items():
        print(f"# skipped {b} for {op}: {why}")
    timing = ("one barrier of the same backend, then -n calls back to back timed as a block "
              "(time = the block's mean on the slowest rank)" if args.timing == "b2b" else
              "time = median over iterations of the slowest rank (a barrier of the same "
              "backend precedes each)")
    print(
        f"# {world} ranks, {args.datatype}, -n {args.iters} -w {args.warmup_iters} "
        f"-c {args.check}; backends {','.join(backends)} interleaved per size in one job "
        f"(order alternating)\n# {timing}; algbw = S/t, busbw = algbw * factor, GB = 1e9; "
        "limit = the busbw if the op's least traffic per rank moved at the rates measured "
        "in this job: the larger of its tensor's bytes at the local rate at that size and "
        "the bytes from other cores at the c2c handoff rate (bench._limit)"
    )
    for op in args.ops:
        mine = [r for r in rows if r["op"] == op]
        print("\n".join(_report.format_op(op, mine, backends, limits.get(op, {}))))
    floors = [g[2] for g in gathered if g[2] is not None]
    floor_us = statistics.median(floors) if floors else None  # rank 0's alone
    if floor_us is not None:
        print(
            f"# dispatch floor: {floor_us:.2f} us per dist.all_reduce on a backend that does "
            "nothing (torch's FakeProcessGroup, timed on rank 0): no backend reached "
            "through dist.all_reduce is faster"
        )
    wrong = sum(r["wrong"] for r in rows if r["wrong"] > 0)
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    meta = {
        **vars(args),
        "requested": args.backends,
        "backends": backends,
        "skipped": skipped,
        "nproc": world,
        "torch": torch.__version__,
        "schedule": "interleaved per size, one job",
        "dispatch_floor_us": floor_us,
        "provenance": {**info, "finished": _provenance.now()},
        "wrong": wrong,
    }
    limit_rows = {op: {str(n): v for n, v in per.items()} for op, per in limits.items()}
    _report.write_json(args.out, meta, rows, {
        "local_gbs": {str(n): g for n, g in local.items()}, "cache_gbs": cache,
        "local_gbs_one_core": {str(n): g for n, g in (gathered[0][3] or {}).items()},
        "handoff_gbs": handoff,
        "ranks_per_core": per_core, "limit_busbw": limit_rows})
    plot = args.out.with_suffix(".png")
    wrote = _report.write_plot(plot, rows, backends, limits, world)
    print(f"# wrote {args.out}" + (f" and {plot}" if wrote else f" ({note('matplotlib', 'plot')})"))
    return wrong


def _rows_with_sweep_size(rows: list[dict], op: str, sizes: list[int]):
    """(row, sweep size) for an op's rows: a row's bytes may be rounded down from the
    sweep size (shares must be whole), and the copy was timed at the sweep size."""
    for r in rows:
        if r["op"] == op:
            yield r, min((n for n in sizes if n >= r["bytes"]), default=sizes[-1])


def _c2c_reading(cpus: set[int]) -> dict | None:
    """A core-to-core reading between two of ``cpus`` (the CPUs this rank could use
    before --bind pinned it), or None where there is no second CPU. The rank's own
    pinning is lifted for the reading and restored after it."""
    pinned = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
        return _c2c.reading()
    except RuntimeError as e:
        print(f"# c2c: no reading ({e})", file=sys.stderr)
        return None
    finally:
        os.sched_setaffinity(0, pinned)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank: join the gloo default group, measure, send timings to rank 0."""
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: one intra-op thread per rank. Idle OpenMP workers spin, and
        # with several ranks per core that spinning steals the cores the ranks need.
        torch.set_num_threads(1)
    cpus = os.sched_getaffinity(0)
    if bind_rank(rank, world, args.bind) is not None:
        args.notes.append(f"each rank pinned to one CPU (--bind {args.bind})")
    _ports.init_default_group("gloo", rank, world)
    placements: list = [None] * world
    dist.all_gather_object(placements, _provenance.placement(rank))
    groups, skipped = make_groups(args.backends)
    if skipped and args.require_all:  # every rank has the same `skipped`: all stop
        raise SystemExit("--require-all: " + "; ".join(f"{b} cannot run: {why}"
                                                        for b, why in skipped.items()))
    info = _provenance.collect(placements, args.argv) if rank == 0 else {}
    info["cpus"] = sorted(cpus)  # before --bind: what the host gives this job
    dist.barrier()  # the others wait (asleep in gloo) while rank 0 reads the cores
    if rank == 0:
        info["c2c_before"] = _c2c_reading(cpus)
    dist.barrier()
    results, cannot = measure(args, groups)
    dist.barrier()
    if rank == 0:
        info["c2c_after"] = _c2c_reading(cpus)
    dist.barrier()
    passes = _limit.time_locals(args.sizes, args.iters, dist.group.WORLD)
    alone = _limit.time_one_core(args.sizes, args.iters, dist.group.WORLD)
    floor = time_dispatch_floor(dist.group.WORLD) if args.sizes[0] <= 4096 else None
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((results, passes, floor, alone), gathered, dst=0)
    wrong = 0
    if rank == 0 and groups:
        wrong = report(args, list(groups), gathered, skipped, cannot, info)
    elif rank == 0:
        print(f"# no backend to run: {skipped}", file=sys.stderr)
    status = [wrong]
    dist.broadcast_object_list(status, src=0)
    close_groups(groups)
    dist.destroy_process_group()
    if status[0]:  # every rank fails, so torchrun, mpirun and spawn all report it
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point (``python -m bench.collectives``): run in place under torchrun or mpirun,
    else start ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "pycomm-registered" in (b.split("#")[0] for b in args.backends):
        _registered_alloc()  # fail here, once, rather than on every rank
    if args.jobs > 1 or args.mpi_tuned or args.tuned or args.load:
        from bench._jobs import run_jobs

        raise SystemExit(run_jobs(argv, args))
    launch(argv, args, worker)


if __name__ == "__main__":
    main()
