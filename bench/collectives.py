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
import os
import statistics
import sys

import torch
import torch.distributed as dist

from bench import _mpi, _report
from bench._cli import DTYPES, parse_args
from bench._launch import bind_rank, launch
from bench._timing import (
    NativeComm,
    TorchComm,
    time_case,
    time_dispatch_floor,
    time_memcpy,
    total_count,
)


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
    if backend.startswith("pycomm"):
        try:
            import pycomm  # noqa: F401  (registers the backend)
        except Exception as exc:  # not built, or built against another torch
            return f"import pycomm failed: {exc!r}"
        backend = "pycomm"
    if backend not in dist.Backend.backend_list:
        return f"backend {backend!r} is not registered"
    return ""


def _comm(backend: str):
    """The communicator the timing loop drives for one backend (a column)."""
    if backend == "mpi":
        return _mpi.MpiComm()
    if backend == "pycomm-registered":
        return TorchComm(dist.new_group(backend="pycomm"), alloc=_registered_alloc())
    if backend == "pycomm-native":
        return NativeComm(dist.new_group(backend="pycomm"))
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
        else:
            groups[b] = _comm(b.split("#")[0])
    return groups, skipped


def _progress(total: int, quiet: bool):
    """A tqdm bar on rank 0 when tqdm is installed and not --quiet, else None."""
    if quiet or dist.get_rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", leave=False, file=sys.stderr)


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


def report(
    args: argparse.Namespace, backends: list[str], gathered: list, skipped: dict, cannot: dict
) -> None:
    """Rank 0: summarise every rank's timings, print the tables, write JSON and the plot.

    ``gathered[r]`` is rank r's (case results, memcpy times, dispatch floor in µs or
    None) as sent by :func:`worker`.
    """
    world = len(gathered)
    rows = [
        _report.summarize(*key, args.datatype, args.redop, [g[0][k][1] for g in gathered], world)
        for k, (key, _) in enumerate(gathered[0][0])
    ]
    limit = _report.memcpy_limit(args.sizes[-1], [g[1] for g in gathered])
    notes = [*args.notes, _mpi.oversubscribed(world) if "mpi" in backends else ""]
    for note in filter(None, notes):
        print(f"# note: {note}")
    for b, why in skipped.items():
        print(f"# skipped {b}: {why}")
    for (b, op), why in cannot.items():
        print(f"# skipped {b} for {op}: {why}")
    print(
        f"# pycomm-bench: {world} ranks, {args.datatype}, -n {args.iters} -w {args.warmup_iters} "
        f"-c {args.check}; backends {','.join(backends)} interleaved per size in one job "
        "(order alternating)\n"
        "# time = median over iterations of the slowest rank (a barrier of the same backend "
        "precedes each); algbw = S/t, busbw = algbw * factor, GB = 1e9"
    )
    for op in args.ops:
        print("\n".join(_report.format_op(op, [r for r in rows if r["op"] == op], backends)))
    print(
        f"# memcpy limit: {limit:.3f} GB/s per rank ({world} ranks copying "
        f"{args.sizes[-1]} B at once)"
    )
    floors = [g[2] for g in gathered if g[2] is not None]
    floor_us = statistics.median(floors) if floors else None  # rank 0's alone
    if floor_us is not None:
        print(
            f"# dispatch floor: {floor_us:.2f} us per dist.all_reduce on a backend that does "
            "nothing (torch's FakeProcessGroup, timed on rank 0): no backend reached "
            "through dist.all_reduce is faster"
        )
    meta = {
        **vars(args),
        "requested": args.backends,
        "backends": backends,
        "skipped": skipped,
        "nproc": world,
        "torch": torch.__version__,
        "schedule": "interleaved per size, one job",
        "dispatch_floor_us": floor_us,
    }
    _report.write_json(args.out, meta, rows, {"bytes": args.sizes[-1], "gbs_per_rank": limit})
    plot = args.out.with_suffix(".png")
    wrote = _report.write_plot(plot, rows, backends, limit, world)
    print(f"# wrote {args.out}" + (f" and {plot}" if wrote else " (no matplotlib: no plot)"))


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank: join the gloo default group, measure, send timings to rank 0."""
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: one intra-op thread per rank. Idle OpenMP workers spin, and
        # with several ranks per core that spinning steals the cores the ranks need.
        torch.set_num_threads(1)
    if bind_rank(rank, world, args.bind) is not None:
        args.notes.append(f"each rank pinned to one CPU (--bind {args.bind})")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups, skipped = make_groups(args.backends)
    results, cannot = measure(args, groups)
    memcpy = time_memcpy(args.sizes[-1], args.iters, dist.group.WORLD)
    floor = time_dispatch_floor(dist.group.WORLD) if args.sizes[0] <= 4096 else None
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((results, memcpy, floor), gathered, dst=0)
    if rank == 0 and groups:
        report(args, list(groups), gathered, skipped, cannot)
    elif rank == 0:
        print(f"# no backend to run: {skipped}", file=sys.stderr)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point (``python -m bench.collectives``): run in place under torchrun or mpirun,
    else start ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "pycomm-registered" in (b.split("#")[0] for b in args.backends):
        _registered_alloc()  # fail here, once, rather than on every rank
    launch(argv, args, worker)


if __name__ == "__main__":
    main()
