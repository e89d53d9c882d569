"""Where a loaded rank's all_reduce time goes: on the CPU, waiting in the run queue, or
asleep (waiting for its peer). Per call, the median over calls of each rank's wall time,
its CPU time (every thread: a backend's own threads count), its context switches
(voluntary: it slept; involuntary: it was preempted), the time its threads spent runnable
but not running (``/proc/self/task/*/schedstat``'s run-queue wait), and the time slices
they got.

With K competing processes per CPU a single-threaded rank gets at most 1/(K+1) of a core,
so its wall time is at least its CPU time x (K+1); what lies beyond is the two ranks
waiting on each other. The table tells a backend that needs less CPU from one that gets
more of it (more runnable threads).

Example::

    python -m records.investigations.sched_share --load 4 --load-kind cpu --size 32M \
        --backends pycomm,gloo
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from bench._cli import parse_size
from bench._load import competing
from pycomm.testing import run_ranks

FIELDS = ("wall_ms", "cpu_ms", "voluntary", "involuntary", "runqueue_ms", "slices")


def schedstat() -> tuple[int, int, int]:
    """This process's threads summed: ns on the CPU, ns runnable but waiting, slices."""
    run = wait = slices = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                a, b, c = f.read().split()
        except (OSError, ValueError):
            continue  # a thread that ended between listdir and open
        run, wait, slices = run + int(a), wait + int(b), slices + int(c)
    return run, wait, slices


def one_call(t: torch.Tensor) -> dict[str, float]:
    dist.barrier()
    s0, r0, w0 = schedstat(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    dist.all_reduce(t)
    w1, r1, s1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), schedstat()
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"wall_ms": (w1 - w0) * 1e3, "cpu_ms": cpu * 1e3,
            "voluntary": r1.ru_nvcsw - r0.ru_nvcsw, "involuntary": r1.ru_nivcsw - r0.ru_nivcsw,
            "runqueue_ms": (s1[1] - s0[1]) / 1e6, "slices": s1[2] - s0[2]}


def rank_body(nbytes: int, iters: int, warmup: int) -> dict[str, float]:
    """Median of each field over `iters` calls (after `warmup`), on this rank."""
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(warmup):
        dist.all_reduce(t)
    calls = [one_call(t) for _ in range(iters)]
    return {k: statistics.median(c[k] for c in calls) for k in FIELDS}


def row(backend: str, rank: int, m: dict[str, float]) -> str:
    return (f"{backend:8s} {rank:4d} {m['wall_ms']:9.2f} {m['cpu_ms']:8.2f} "
            f"{m['voluntary']:6.0f} {m['involuntary']:6.0f} {m['runqueue_ms']:10.2f} "
            f"{m['slices']:6.0f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="pycomm,gloo")
    p.add_argument("--size", default="32M", help="message size (K, M suffixes)")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="each backend this many times, "
                   "interleaved")
    p.add_argument("--load", type=int, default=4, help="competing processes per CPU")
    p.add_argument("--load-kind", choices=("cpu", "mem"), default="cpu")
    p.add_argument("--gloo-ifname", default="", help="GLOO_SOCKET_IFNAME for gloo's ranks "
                   "(lo: the loopback's 64 KiB MTU, gloo's best setting here; see bench._gloo)")
    args = p.parse_args(argv)
    nbytes = parse_size(args.size)
    gloo = f"; gloo on GLOO_SOCKET_IFNAME={args.gloo_ifname}" if args.gloo_ifname else ""
    print(f"# {args.size} all_reduce, 2 ranks, load {args.load} {args.load_kind} per CPU; "
          f"medians over {args.iters} calls{gloo}")
    print("# backend  rank   wall ms   cpu ms  volun  invol  runq-wait ms slices")
    with competing(args.load, args.load_kind):
        for _ in range(args.rounds):
            for backend in args.backends.split(","):
                env = ({"GLOO_SOCKET_IFNAME": args.gloo_ifname}
                       if backend == "gloo" and args.gloo_ifname else None)
                results = run_ranks(rank_body, 2, nbytes, args.iters, args.warmup,
                                    backend=backend, timeout_s=600, env=env)
                for rank, m in enumerate(results):
                    print(row(backend, rank, m), flush=True)


if __name__ == "__main__":
    main()
