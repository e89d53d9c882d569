"""Where a small ``dist.all_reduce``'s time goes when ranks share cores: the op itself,
or the skew the barrier before it leaves between the ranks.

Every combination of a barrier (``dist.barrier`` through torch, or pycomm's own
``barrier_now``) and a small all_reduce (``dist.all_reduce`` or ``pycomm.all_reduce_``)
is timed per call, interleaved in rounds; each line is the median over calls of the
slowest rank's time. With more ranks than cores, a rank that reaches the op first waits
for ranks still running Python, so what precedes the op counts as much as the op.

Example::

    python -m records.investigations.barrier_skew --nproc 4
"""

from __future__ import annotations

import argparse
import os
import queue as queue_mod
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._ports import hosted_store, init_default_group

WARMUP = 100


def _cases(x: torch.Tensor):
    """{(barrier, op): (barrier call, op call)} for this rank's pycomm world group."""
    import pycomm

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    barriers = {"dist.barrier": dist.barrier, "barrier_now": backend.barrier_now}
    ops = {
        "dist.all_reduce": lambda: dist.all_reduce(x),
        "pycomm.all_reduce_": lambda: pycomm.all_reduce_(x),
    }
    return {(b, o): (bf, of) for b, bf in barriers.items() for o, of in ops.items()}


def _time_rank(rank: int, world: int, calls: int, rounds: int, queue) -> None:
    import pycomm  # noqa: F401  (registers the backend in this fresh process)

    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    init_default_group("pycomm", rank, world)
    cases = _cases(torch.ones(4))
    mine: dict = {key: [] for key in cases}
    for round_ in range(rounds):
        for key, (barrier, op) in cases.items():
            for i in range(WARMUP + calls):
                barrier()
                start = time.perf_counter()
                op()
                if i >= WARMUP and round_:  # round 0 warms every case up
                    mine[key].append(time.perf_counter() - start)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        for key in cases:
            calls_timed = range(len(mine[key]))
            slowest = [max(per_rank[key][i] for per_rank in gathered) for i in calls_timed]
            queue.put((key, statistics.median(slowest) * 1e6))
        queue.put(None)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    """Run the ranks; print and return {(barrier, op): µs}."""
    p = argparse.ArgumentParser(prog="python -m records.investigations.barrier_skew",
                                description=__doc__)
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--calls", type=int, default=500, help="timed calls per case and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds (the first is warm-up)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with hosted_store(args.nproc):  # the ranks inherit its port (bench._ports)
        ranks = [
            ctx.Process(target=_time_rank, args=(r, args.nproc, args.calls, args.rounds, queue))
            for r in range(args.nproc)
        ]
        for proc in ranks:
            proc.start()
        try:
            results = _collect(queue, ranks, args.nproc)
        finally:
            for proc in ranks:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    return results


def _collect(queue, ranks, nproc: int) -> dict:
    """Rank 0's lines as they come; an error, not a hang, when a rank dies first."""
    results = {}
    while True:
        try:
            item = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(
                    f"barrier_skew: rank(s) exited early (rank, exit code): {dead}"
                ) from None
            continue
        if item is None:
            return results
        (barrier, op), us = item
        results[(barrier, op)] = us
        print(f"{nproc} ranks: {barrier:13s} then {op:19s} {us:8.1f} us")


if __name__ == "__main__":
    main()
