"""The limit column's two machine states, side by side in one job.

``python -m records.investigations.limit_states [--bytes 64M] [--iters 120] [--out FILE.json]``

2 pinned ranks repeat, each iteration: a pycomm all_reduce of ``--bytes`` of an ordinary
tensor (a barrier before it), the same of an arena tensor (``pycomm.empty``: the peers
read it in place, with no staging copy), a read-modify-write pass over a private buffer
of the same size (the limit column's tensor rate, bench/_limit.py), and 30 all_reduces
of 16 bytes (their fastest is the cores' round trip at that moment). Interleaved, each
all_reduce is paired with the rate the memory gave in the same second, where a table's
limit, measured once per run, may come from another state of a VM whose placement moves
every few seconds.

The iterations are cut into two groups by their pass time (the larger gap in the
sorted times): printed per group are its count, the medians of the readings and of pass
time / all_reduce time for each kind of tensor (the fraction of the limit's tensor term).
The ordinary tensor's gap to the arena tensor's is what staging through the channel's
slots costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.distributed as dist

from bench import _c2c, _launch, _limit, _ports, _provenance
from bench._cli import parse_size

SMALL_CALLS = 30


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def smallest_latency_us(tiny: torch.Tensor) -> float:
    times = []
    for _ in range(SMALL_CALLS):
        start = time.perf_counter()
        dist.all_reduce(tiny)
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    import pycomm  # registers the backend

    torch.set_num_threads(1)
    _launch.bind_rank(rank, world, "core")
    _ports.init_default_group("pycomm", rank, world)  # the launcher holds its store
    data, private = torch.randn(args.bytes // 4), torch.ones(args.bytes // 4)
    arena = pycomm.empty(args.bytes // 4)
    arena.copy_(data)
    tiny = torch.zeros(4)
    rows = []
    for i in range(args.iters + 3):  # the first passes fault pages in: not kept
        ar = timed(lambda: dist.all_reduce(data))
        ar_arena = timed(lambda: dist.all_reduce(arena))
        rmw = timed(lambda: _limit.rmw_pass(private))
        small = smallest_latency_us(tiny)
        if i >= 3:
            rows.append({"all_reduce_ms": ar * 1e3, "arena_all_reduce_ms": ar_arena * 1e3,
                         "rmw_ms": rmw * 1e3, "small_us": small})
    dist.destroy_process_group()
    if rank == 0:
        report(rows, args)


def split_by_pass_time(rows: list[dict]) -> list[list[dict]]:
    """Two groups at the largest gap between consecutive pass times (one if all alike)."""
    ordered = sorted(rows, key=lambda r: r["rmw_ms"])
    gaps = [(b["rmw_ms"] - a["rmw_ms"], i + 1) for i, (a, b) in
            enumerate(itertools.pairwise(ordered))]
    if not gaps:
        return [ordered]
    width, at = max(gaps)
    spread = ordered[-1]["rmw_ms"] - ordered[0]["rmw_ms"]
    if width < 0.25 * spread or min(at, len(ordered) - at) < 3:
        return [ordered]
    return [ordered[:at], ordered[at:]]


def describe(group: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in group) for k in group[0]}
    med["fraction"] = statistics.median(r["rmw_ms"] / r["all_reduce_ms"] for r in group)
    med["arena_fraction"] = statistics.median(r["rmw_ms"] / r["arena_all_reduce_ms"]
                                              for r in group)
    med["iterations"] = len(group)
    return med


def report(rows: list[dict], args: argparse.Namespace) -> None:
    groups = [describe(g) for g in split_by_pass_time(rows)]
    print(f"{args.bytes >> 20} MB, 2 ranks pinned, {len(rows)} interleaved iterations; "
          f"commit {_provenance.git_commit()}; {_c2c.describe(args.c2c_before)}")
    print("| pass group | iterations | all_reduce ms | arena all_reduce ms | rmw pass ms "
          "| 16 B all_reduce µs | rmw / all_reduce | rmw / arena all_reduce |")
    print("|---|---|---|---|---|---|---|---|")
    for name, g in zip(("faster pass", "slower pass"), groups, strict=False):
        print(f"| {name} | {g['iterations']} | {g['all_reduce_ms']:.2f} "
              f"| {g['arena_all_reduce_ms']:.2f} | {g['rmw_ms']:.2f} | {g['small_us']:.2f} "
              f"| {g['fraction']:.2f} | {g['arena_fraction']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"bytes": args.bytes, "commit": _provenance.git_commit(),
                                "when": _provenance.now(), "c2c_before": args.c2c_before},
                       "groups": groups, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m records.investigations.limit_states",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=parse_size, default=64 << 20)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--out", help="write every iteration and the groups here (JSON)")
    args = p.parse_args(argv)
    args.nproc, args.backends = 2, ["pycomm"]
    args.c2c_before = _c2c.reading()
    _launch.launch([], args, worker)


if __name__ == "__main__":
    main()
