"""Consistency models of parallel.ps side by side: BSP, SSP (tau 2, 8) and async.

``python -m bench.ps_consistency`` runs the sparse logistic-regression example
(``pycomm.parallel.ps.examples.logreg``: 1e6 features, density 1e-4, 4 workers, 2 servers) once
per model, one worker slowed by ``--slow-ms`` after each step (the straggler bounded
delay is for), and reads each job's metrics lines. It writes a Markdown table (final
held-out loss, its difference from BSP's, the time to finish, worker steps per second),
the same as JSON, and a PNG of training loss against wall time, one line per model.

Times come from the metrics lines: each worker stamps its lines with the seconds since
it started, and workers start at different moments (importing torch on 2 busy cores),
so a worker's clock is taken from the end of its first step. Every worker runs the same
number of steps and the job ends at a barrier, so the straggler bounds the end in every
model; what SSP and async change is how far the others get meanwhile (the loss curve and
"fastest worker done").

Also used by ``bench.ps_traffic``: :func:`run_logreg`, :func:`steps_of`, :func:`final_loss`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pycomm.parallel._optional import available

Row = dict[str, Any]
MODELS = {"bsp": ("bsp", 0), "ssp tau=2": ("ssp", 2), "ssp tau=8": ("ssp", 8),
          "async": ("async", 0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ps_consistency",
                                description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--features", type=int, default=10**6)
    p.add_argument("--density", type=float, default=1e-4)
    p.add_argument("--slow-worker", type=int, default=3)
    p.add_argument("--slow-ms", type=float, default=150.0, help="the straggler's sleep "
                   "after each step (about one step of the others on this machine)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    p.add_argument("--bin", type=float, default=0.25, help="seconds per loss-curve bin")
    p.add_argument("--out", type=Path, default=Path("records/ps"))
    return p.parse_args(argv)


def run_logreg(flags: list[str], metrics: Path, timeout_s: float = 600.0) -> float:
    """One job of the example with ``flags`` writing ``metrics``; returns its wall seconds
    (launch to exit, startup included). Raises on a failing job."""
    metrics.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pycomm.parallel.ps.examples.logreg", *flags,
           "--metrics", str(metrics)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"logreg job failed ({done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return wall


def read_lines(metrics: Path) -> list[Row]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def steps_of(lines: list[Row]) -> list[Row]:
    """The step lines, each with ``wall``: seconds since its worker's first step ended."""
    steps = [r for r in lines if "step" in r]
    first: dict[int, float] = {}
    for r in steps:
        first[r["worker"]] = min(r["t"], first.get(r["worker"], r["t"]))
    for r in steps:
        r["wall"] = r["t"] - first[r["worker"]]
    return sorted(steps, key=lambda r: r["wall"])


def final_loss(lines: list[Row]) -> float:
    return float(next(r["final_loss"] for r in lines if "final_loss" in r))


def finish_time(lines: list[Row]) -> float:
    """Worker 0's final-loss line (after the closing barrier) on its step clock."""
    t0 = min(r["t"] for r in lines if "step" in r and r["worker"] == 0)
    return float(next(r["t"] for r in lines if "final_loss" in r)) - t0


def max_lead(steps: list[Row]) -> int:
    """The most steps any worker was ahead of the slowest other, as the lines show it
    (approximate: the workers' clocks are aligned at their first step)."""
    done: dict[int, int] = dict.fromkeys({r["worker"] for r in steps}, 0)
    lead = 0
    for r in steps:  # sorted by wall time
        done[r["worker"]] = r["clock"]
        lead = max(lead, r["clock"] - min(done.values()))
    return lead


def loss_curve(steps: list[Row], width: float) -> tuple[list[float], list[float]]:
    """Mean training loss over the step lines of each ``width``-second bin."""
    bins: dict[int, list[float]] = {}
    for r in steps:
        bins.setdefault(int(r["wall"] // width), []).append(r["loss"])
    keys = sorted(bins)
    return [(k + 0.5) * width for k in keys], [statistics.fmean(bins[k]) for k in keys]


def summarize(name: str, lines: list[Row], job_wall: float) -> Row:
    steps = steps_of(lines)
    done = [max(r["wall"] for r in steps if r["worker"] == w) for w in {r["worker"] for r in steps}]
    finish = finish_time(lines)
    return {"model": name, "final_loss": final_loss(lines), "finish_s": finish,
            "fastest_done_s": min(done), "worker_steps_per_s": len(steps) / finish,
            "max_lead": max_lead(steps), "job_wall_s": job_wall}


def table(rows: list[Row]) -> list[str]:
    base = next((r["final_loss"] for r in rows if r["model"] == "bsp"), rows[0]["final_loss"])
    out = ["| model | final held-out loss | vs BSP | time to finish (s) | fastest worker "
           "done (s) | worker steps/s | max lead (steps) | job wall incl. startup (s) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = (r["final_loss"] - base) / base
        out.append(f"| {r['model']} | {r['final_loss']:.4f} | {rel:+.2%} | {r['finish_s']:.1f} | "
                   f"{r['fastest_done_s']:.1f} | {r['worker_steps_per_s']:.1f} | "
                   f"{r['max_lead']} | {r['job_wall_s']:.0f} |")
    return out


def plot(curves: dict[str, tuple[list[float], list[float]]], path: Path, title: str) -> bool:
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("training loss (mean over workers per bin)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


COLUMNS = """\
Columns: "vs BSP" is (final loss - BSP's) / BSP's, on the same 512 held-out examples.
Times are seconds from the end of a worker's own first step: "time to finish" to worker
0's final-loss line (after the closing barrier, so after the straggler's last step),
"fastest worker done" to the fastest worker's last step. "worker steps/s" = all workers' steps /
time to finish. "max lead" = the largest (a worker's clock - the slowest clock) in the
lines' order; a clock ticks before the next pull waits, so BSP shows 1 and SSP tau shows
tau + 1. "job wall" adds starting 7 Python processes (torch imported in each)."""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--servers", str(args.servers), "--workers", str(args.workers), "--steps",
              str(args.steps), "--lr", str(args.lr), "--features", str(args.features),
              "--density", str(args.density), "--slow-worker", str(args.slow_worker),
              "--slow-ms", str(args.slow_ms)]
    load_before, rows, curves = load(), [], {}
    for name in [m for m in args.models.split(",") if m]:
        mode, tau = MODELS[name]
        metrics = args.out / "metrics" / f"consistency-{mode}{tau or ''}.jsonl"
        wall = run_logreg([*common, "--consistency", mode, "--tau", str(tau)], metrics)
        lines = read_lines(metrics)
        rows.append(summarize(name, lines, wall))
        curves[name] = loss_curve(steps_of(lines), args.bin)
        print(f"{name}: final loss {rows[-1]['final_loss']:.4f}, {wall:.0f} s", flush=True)
    setup = (f"{args.workers} workers, {args.servers} servers, {args.steps} steps, lr {args.lr}, "
             f"{args.features} features, density {args.density}, worker {args.slow_worker} "
             f"sleeps {args.slow_ms:g} ms after each step")
    notes = [f"Setup: {setup}. Load average (1, 5, 15 min) before: {load_before}; "
             f"after: {load()}.", ""]
    lines_md = ["# parallel.ps consistency models (bench/ps_consistency.py)", "", *notes,
                *table(rows), "", COLUMNS, ""]
    (args.out / "consistency.md").write_text("\n".join(lines_md))
    (args.out / "consistency.json").write_text(json.dumps(
        {"setup": setup, "rows": rows, "curves": curves}, indent=1))
    plot(curves, args.out / "consistency.png", setup)
    print("\n".join(lines_md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
