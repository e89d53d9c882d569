"""What a blocking collective costs beyond its own time when ranks outnumber the CPUs.

A rank that reaches a collective first waits for peers the scheduler has not run yet;
the one that wakes it may have to wait for a time slice before it runs again. Neither
shows in the collective benchmark (ranks call it back to back) nor in the compute
calibration (one process): it is measured here once, as the step the planner predicts
would see it: ``world`` ranks alternate ``compute_s`` of matrix products (single-core
time) with a one-element all-reduce, against the same ranks computing alone. The
difference per iteration is the wait.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

LOOP_S = 0.25  # single-core seconds of compute per timed loop, 10 to 100 iterations


def _chunk(target_s: float) -> tuple[Any, int]:
    """A matmul and the repetitions of it that take ``target_s`` on one core."""
    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    per = (time.perf_counter() - start) / 50
    return a, max(1, round(target_s / per))


def _rank_probe(compute_s: list[float], threads: int) -> list[tuple[float, float]]:
    """Per ``compute_s``: (seconds per iteration with a collective after each chunk,
    seconds per iteration without), the slowest rank's median of 3 tries."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    one = torch.ones(1)
    out = []
    for target in compute_s:
        a, reps = _chunk(target)
        iters = min(100, max(10, round(LOOP_S / target)))

        def loop(sync: bool, a: torch.Tensor = a, reps: int = reps, iters: int = iters) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                for _ in range(reps):
                    a @ a
                if sync:
                    dist.all_reduce(one)
            took = torch.tensor([(time.perf_counter() - start) / iters])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took)

        tries = [(loop(True), loop(False)) for _ in range(3)]
        out.append((statistics.median(t[0] for t in tries),
                    statistics.median(t[1] for t in tries)))
    return out


def sync_waits(world: int, compute_s: tuple[float, ...], threads: int = 1) -> list[float]:
    """Seconds a blocking collective adds per call at each ``compute_s`` of compute
    between calls (never negative), for ``world`` ranks of ``threads`` threads on this
    machine's CPUs."""
    from pycomm.testing import run_ranks

    per_rank = run_ranks(_rank_probe, world, list(compute_s), threads, timeout_s=300)
    with_sync = per_rank[0]  # every rank returns the same (MAX over ranks)
    return [max(0.0, w - alone) for w, alone in with_sync]
