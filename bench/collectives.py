"""Collective benchmark, nccl-tests style: pycomm and gloo side by side in one run.

``python -m bench.collectives`` spawns ``--nproc`` local ranks itself; under
``torchrun`` (RANK and WORLD_SIZE set) it runs in place. All ranks join one
gloo default group (used only to collect timings) plus one group per backend
under test, and for each op and size the backends run one after the other
(interleaved, order alternating per size) so that machine noise hits both.

Example::

    python -m bench.collectives -b 1K -e 64M -f 4 --ops all_reduce,all_gather -c 1
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from bench import _report
from bench._cli import DTYPES, parse_args
from bench._timing import time_case, time_memcpy, total_count


def _available(backend: str) -> str:
    """Why ``backend`` cannot be used here, or '' when it can."""
    if backend == "pycomm":
        try:
            import pycomm  # noqa: F401  (registers the backend)
        except Exception as exc:  # not built, or built against another torch
            return f"import pycomm failed: {exc!r}"
    if backend not in dist.Backend.backend_list:
        return f"backend {backend!r} is not registered"
    return ""


def make_groups(backends: list[str]) -> tuple[dict, dict]:
    """One group per backend usable on every rank, and {backend: why} for the others.

    Every rank creates the groups in the same order, as ``new_group`` requires.
    """
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, [_available(b.split("#")[0]) for b in backends])
    groups, skipped = {}, {}
    for i, b in enumerate(backends):
        why = next((r[i] for r in reasons if r[i]), "")
        if why:
            skipped[b] = why
        else:
            groups[b] = dist.new_group(backend=b.split("#")[0])
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


def measure(args: argparse.Namespace, groups: dict) -> list[tuple]:
    """Run every (op, size, backend) case; this rank's (key, result) pairs."""
    dtype, world = DTYPES[args.datatype], dist.get_world_size()
    bar = _progress(len(args.ops) * len(args.sizes) * len(groups), args.quiet)
    out = []
    for op in args.ops:
        for i, nbytes in enumerate(args.sizes):
            count = total_count(op, nbytes, dtype.itemsize, world)
            order = list(groups) if i % 2 == 0 else list(groups)[::-1]
            for b in order:
                res = time_case(op, count, dtype, groups[b], args)
                out.append(((op, b, count * dtype.itemsize, count), res))
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return out


def report(args: argparse.Namespace, backends: list[str], gathered: list, skipped: dict) -> None:
    """Rank 0: summarise every rank's timings, print the tables, write JSON and the plot.

    ``gathered[r]`` is rank r's (case results, memcpy times) as sent by :func:`worker`.
    """
    world = len(gathered)
    rows = [
        _report.summarize(*key, args.datatype, args.redop, [g[0][k][1] for g in gathered], world)
        for k, (key, _) in enumerate(gathered[0][0])
    ]
    limit = _report.memcpy_limit(args.sizes[-1], [g[1] for g in gathered])
    for b, why in skipped.items():
        print(f"# skipped {b}: {why}")
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
    meta = {
        **vars(args),
        "requested": args.backends,
        "backends": backends,
        "skipped": skipped,
        "nproc": world,
        "torch": torch.__version__,
        "schedule": "interleaved per size, one job",
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
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups, skipped = make_groups(args.backends)
    results = measure(args, groups)
    memcpy = time_memcpy(args.sizes[-1], args.iters, dist.group.WORLD)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((results, memcpy), gathered, dst=0)
    if rank == 0 and groups:
        report(args, list(groups), gathered, skipped)
    elif rank == 0:
        print(f"# no backend to run: {skipped}", file=sys.stderr)
    dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the spawned ranks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    """Entry point (``pycomm-bench``): run in place under torchrun, else spawn ranks."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:  # the spawned ranks inherit the rendezvous address from this environment
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


if __name__ == "__main__":
    main()
