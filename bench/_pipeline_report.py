"""``bench.training pipeline``: runs the pipeline measurements and prints their tables."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from bench._pipeline_bench import (
    PipeSetup,
    activation_memory,
    bubbles,
    peak_rss,
    time_pipelines,
)
from pycomm.testing import run_ranks

MB = 1 << 20
BUBBLE_MICRO = [1, 4, 16]


def setup_of(args: argparse.Namespace) -> PipeSetup:
    return PipeSetup(args.width, args.layers, args.rows, args.chunks, args.steps, args.rounds,
                     args.warmup)


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    setup = setup_of(args)
    per_rank = run_ranks(time_pipelines, args.nproc, args.strategies, setup, timeout_s=3600.0)
    rows: dict[str, Any] = {}
    for name in args.strategies:
        slowest = [max(s) for s in zip(*(r[name] for r in per_rank), strict=True)]
        median = statistics.median(slowest)
        q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else [median] * 3
        rows[name] = {"median_ms": median * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3,
                      "rows_per_s": setup.rows / median}
        if not args.no_memory:
            # Peak RSS of the same job moves by +-10 MB between fresh runs here, more than
            # the strategies differ by: the median over jobs of the largest rank.
            jobs = [max(run_ranks(peak_rss, args.nproc, name, setup, timeout_s=600.0)) / MB
                    for _ in range(max(1, args.memory_jobs))]
            rows[name]["peak_rss_mb"] = statistics.median(jobs)
            rows[name]["peak_rss_jobs_mb"] = jobs
    png = str(args.out.with_name(args.out.stem + "_timeline.png"))
    bubble_jobs = [run_ranks(bubbles, args.nproc, setup, BUBBLE_MICRO, png if j == 0 else None,
                             timeout_s=1200.0)[0] for j in range(max(1, args.bubble_jobs))]
    memory = run_ranks(activation_memory, args.nproc,
                       PipeSetup(**{**setup.__dict__, "chunks": 16}), timeout_s=1200.0)
    return {"strategies": rows, **bubble_summary(bubble_jobs), "activation_bytes": memory,
            "timeline_png": png}


def bubble_summary(jobs: list[dict[int, dict[int, float]]]) -> dict[str, Any]:
    """Per M and stage: the median idle share over the jobs (``bubble``), and every job's
    value (``bubble_jobs``). Each job is a fresh set of processes: on a small shared
    machine the stage that lands on the busier CPU is slower for the whole job, so one
    job's cells can sit off the formula in either direction; the median over jobs does not."""
    cells = {str(m): {str(s): [job[m][s] for job in jobs] for s in jobs[0][m]} for m in jobs[0]}
    median = {m: {s: statistics.median(v) for s, v in st.items()} for m, st in cells.items()}
    return {"bubble": median, "bubble_jobs": cells}


def print_pipeline(args: argparse.Namespace, res: dict[str, Any]) -> None:
    k = args.nproc
    print(f"# bench.training pipeline: {k} stages, MLP of {args.layers} x (Linear({args.width}, "
          f"{args.width}) + GELU), {args.rows} rows per step in {args.chunks} micro-batches, "
          f"SGD; {args.rounds} rounds x {args.steps} steps, interleaved; slowest stage per "
          "step, median (p25-p75); parallel.pipeline without re-materialization (as torch's); "
          f"peak RSS: the largest rank's, median of {args.memory_jobs} fresh jobs")
    print(f"{'strategy':<30} {'step ms':>9} {'p25-p75 ms':>17} {'rows/s':>9} {'peak RSS MB':>12}")
    for name, r in res["strategies"].items():
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"
        print(f"{name:<30} {r['median_ms']:>9.1f} {r['p25_ms']:>8.1f}-{r['p75_ms']:<8.1f} "
              f"{r['rows_per_s']:>9.0f} {rss:>12}")
    _print_targets(res["strategies"])
    jobs = max(1, args.bubble_jobs)
    print("# bubble (GPipe, equal stages, idle share of the step per stage) vs (K-1)/(M+K-1), "
          f"median of {jobs} jobs (min-max):")
    for m, fractions in res["bubble"].items():
        formula = (k - 1) / (int(m) + k - 1)
        spread = res["bubble_jobs"][m]
        cells = ", ".join(f"stage {s}: {f:.3f} ({min(spread[s]):.3f}-{max(spread[s]):.3f})"
                          for s, f in fractions.items())
        print(f"#   M={m:>2}: formula {formula:.3f}; measured {cells}")
    print("# activation memory held for backward, M=16 (MB per stage, stage 0 first):")
    for key in res["activation_bytes"][0]:
        cells = " ".join(f"{r[key] / MB:7.2f}" for r in res["activation_bytes"])
        print(f"#   {key:<20} {cells}")
    print(f"# timeline: {res['timeline_png']}")


def _print_targets(rows: dict[str, Any]) -> None:
    for sched in ("gpipe", "1f1b"):
        ours, peer = rows.get(f"parallel.pipeline-{sched}-pycomm"), rows.get(
            f"torch-{sched}-gloo")
        if ours and peer:
            line = (f"# {sched}: parallel.pipeline-pycomm / torch-gloo: throughput "
                    f"{ours['rows_per_s'] / peer['rows_per_s']:.3f} (target >= 1)")
            if "peak_rss_mb" in ours and "peak_rss_mb" in peer:
                line += f", peak RSS {ours['peak_rss_mb'] / peer['peak_rss_mb']:.3f} (<= 1)"
            print(line)


def write_pipeline(args: argparse.Namespace, res: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "results": res}, indent=1))
    print(f"# wrote {args.out}")
