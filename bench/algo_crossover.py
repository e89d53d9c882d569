"""pycomm's algorithms and settings against each other, timed in one job.

Each rank makes one pycomm group per variant over the same ranks, each created with its
own ``PYCOMM_*`` settings (by default what the automatic choice picks between: the
zero-copy negotiation then the streamed algorithm, ``PYCOMM_DIRECT_BYTES=0``, which is
the pair exchange at two ranks and the two-shot at more; the ring, which the two-shot
replaced, ``PYCOMM_TWO_SHOT_BYTES=0``, at more than two ranks; and the direct
algorithm, ``PYCOMM_ALGO=direct`` with an area as large as the largest size), and times
``pycomm.all_reduce_`` on each, rotating the order per call with a barrier before every
call, so all see the same machine state (``--op``: reduce_scatter or all_gather instead,
through ``dist``). Each line is the median over calls of the
slowest rank's time, and each variant's time over the first's (below 1: faster).
``PYCOMM_DIRECT_BYTES``', ``PYCOMM_CHUNK_BYTES``' and ``PYCOMM_TWO_SHOT_*``' defaults
come from these tables.

Example::

    python -m bench.algo_crossover --nproc 2 -b 4K -e 1M --iters 400
    python -m bench.algo_crossover --variant ring=PYCOMM_ALGO=ring \
        --variant ring-16k=PYCOMM_ALGO=ring,PYCOMM_CHUNK_BYTES=16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import _c2c
from bench._cli import parse_size
from bench._launch import bind_rank
from bench._ports import hosted_store, init_default_group


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'name=K=V,K2=V2' -> (name, {K: V, K2: V2})."""
    name, _, settings = text.partition("=")
    env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    if not name or not all(k.startswith("PYCOMM_") for k in env):
        raise SystemExit(f"--variant {text!r}: want NAME=PYCOMM_X=V[,PYCOMM_Y=W]")
    return name, env


def default_variants(max_bytes: int, nproc: int) -> list[tuple[str, dict[str, str]]]:
    """What the automatic choice picks between: above the direct size it negotiates
    zero-copy and, for ordinary tensors, streams (a direct size of 0 forces that path at
    every size): the pair exchange at two ranks, the two-shot at more, where the ring
    it replaced is timed beside it; and the direct algorithm at every size."""
    streamed = [("pair" if nproc == 2 else "two-shot", {"PYCOMM_DIRECT_BYTES": "0"})]
    if nproc > 2:
        streamed.append(("ring", {"PYCOMM_DIRECT_BYTES": "0", "PYCOMM_TWO_SHOT_BYTES": "0"}))
    return [*streamed,
            ("direct", {"PYCOMM_ALGO": "direct", "PYCOMM_DIRECT_BYTES": str(max_bytes)})]


def _group(ranks: list[int], env: dict[str, str]) -> dist.ProcessGroup:
    """A pycomm group made while ``env`` is set (rank 0's settings are the group's)."""
    with mock.patch.dict(os.environ, env):
        return dist.new_group(ranks, backend="pycomm")


def _time(op, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    op()
    return (time.perf_counter() - t0) * 1e6


def _op(name: str, size: int, group: dist.ProcessGroup, world: int):
    """One call of op ``name`` on a message of ``size`` bytes as the core counts it:
    all_reduce's buffer, reduce_scatter's whole input, all_gather's input."""
    import pycomm

    if name == "all_reduce":
        x = torch.ones(size // 4)
        return lambda: pycomm.all_reduce_(x, group=group)
    if name == "reduce_scatter":
        x, out = torch.ones(size // 4 // world * world), torch.empty(size // 4 // world)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    x, out = torch.ones(size // 4), torch.empty(size // 4 * world)
    return lambda: dist.all_gather_into_tensor(out, x, group=group)


def _worker(rank: int, world: int, args: argparse.Namespace, out) -> None:
    import pycomm  # noqa: F401  registers the backend in this spawned rank

    bind_rank(rank, world, args.bind)
    init_default_group("pycomm", rank, world)
    ranks = list(range(world))
    groups = {name: _group(ranks, env) for name, env in args.variants}
    names = list(groups)
    size, rows = args.min, []
    while size <= args.max:
        ops = {a: _op(args.op, size, g, world) for a, g in groups.items()}
        bars = {a: (lambda g=g: dist.barrier(group=g)) for a, g in groups.items()}
        times: dict[str, list[float]] = {a: [] for a in names}
        for i in range(args.warmup + args.iters):
            for a in names[i % len(names):] + names[: i % len(names)]:
                t = _time(ops[a], bars[a])
                if i >= args.warmup:
                    times[a].append(t)
        slowest = {}
        for a in names:  # per call, the slowest rank's time
            mine = torch.tensor(times[a], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            slowest[a] = statistics.median(mine.tolist())
        rows.append({"bytes": size, **slowest})
        size *= args.factor
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace, out) -> None:
    _worker(rank, world, args, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.algo_crossover", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("-b", dest="min", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", dest="max", type=parse_size, default=parse_size("1M"))
    p.add_argument("-f", dest="factor", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--bind", choices=("core", "none", "auto"), default="auto")
    p.add_argument("--variant", action="append", type=parse_variant, dest="variants",
                   help="NAME=PYCOMM_X=V[,...]: a group made with these settings (repeat)")
    p.add_argument("--op", choices=("all_reduce", "reduce_scatter", "all_gather"),
                   default="all_reduce", help="all_reduce through pycomm.all_reduce_, the "
                   "others through dist (size: reduce_scatter's whole input, all_gather's input)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.variants = args.variants or default_variants(args.max, args.nproc)
    import pycomm  # noqa: F401  registers the backend before the ranks start

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    # Which algorithm wins moves with the cores' state (how many hand-offs a schedule
    # has matters most when a hand-off is slow), so the job says which it ran in.
    c2c = [_c2c.reading()]
    with hosted_store(args.nproc):  # the ranks inherit its port (bench._ports)
        mp.start_processes(_spawned, args=(args.nproc, args, out), nprocs=args.nproc,
                           start_method="spawn")
        rows = out.get()
    c2c.append(_c2c.reading())
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    call = "pycomm.all_reduce_" if args.op == "all_reduce" else f"dist.{args.op}"
    print(f"# {args.nproc} ranks, float32 sum, {call}, barrier before each call, "
          f"median of {args.iters} calls (slowest rank); load {' '.join(load)}")
    print(f"# c2c before: {_c2c.describe(c2c[0])}; after: {_c2c.describe(c2c[1])}")
    names = [name for name, _ in args.variants]
    for name, env in args.variants:
        print(f"# {name}: {','.join(f'{k}={v}' for k, v in env.items())}")
    print(f"{'size':>10} | " + " | ".join(f"{n + ' us':>12}" for n in names)
          + "".join(f" | {n}/{names[0]}" for n in names[1:]))
    for r in rows:
        print(f"{r['bytes']:>10} | " + " | ".join(f"{r[n]:12.1f}" for n in names)
              + "".join(f" | {r[n] / r[names[0]]:{len(n) + len(names[0]) + 1}.2f}"
                        for n in names[1:]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"nproc": args.nproc, "op": args.op, "variants": dict(args.variants),
                       "load": load, "c2c": c2c, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
