"""``python -m bench.step_time``: the training step a user times, per layout and backend.

For 2 ranks, each model (the project's GPT; HuggingFace's LlamaForCausalLM from a
LlamaConfig, built in-process, no download) under each layout (torch DDP; torch FSDP2,
``fully_shard`` per block and root; the trainer's ``pycomm.parallel.parallelize`` as dp=2,
dp=2 ZeRO-3, tp=2 and pp=2), over each backend (gloo; pycomm; torch's ``fake``, whose
collectives return at once: the same per-rank compute without communication), with
1 intra-op thread per rank and with torch's default count (compute threads competing
with communication for the cores; each thread setting is its own job of fresh ranks,
set before torch's pool first runs; OMP_WAIT_POLICY and the like are in the JSON, as
libgomp's spinning threads dominate the default-thread rows). One step = forward +
backward + AdamW step on the same global batch (``--batch`` sequences of ``--seq``
tokens; data-parallel ranks split it; the trainer's engine also sums the gradient norm,
one scalar all-reduce).

Step ms: per step the slowest rank's time; the median over a round's steps; then the
median [min-max] over rounds (with ``--jobs K``: the median [min-max] over K fresh jobs
of each job's median). Exposed comm ms = step ms - the fake backend's step ms of the
same model, layout and threads (0 for fake by definition). All backends of a layout
live in the same ranks and take turns, rotating every round, so noise hits them alike.
A cell that cannot run says why in its row (pp has no fake baseline: torch's fake
backend does not carry send/recv, so pp rows have no exposed comm). Denormals are
flushed in every rank, for every backend alike.

Example::

    python -m bench.step_time --models gpt --layouts ddp,dp --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench._model_zoo import Size, build
from bench._provenance import environment, now
from bench._step_layouts import LAYOUTS, Work
from bench._step_ranks import Timing, time_cells
from pycomm.testing import run_ranks

DEFAULT_THREADS = torch.get_num_threads()  # torch's choice, read before anyone sets it
SIZES = {
    # ~4.2M (GPT) / ~3.4M (Llama) parameters: a full run takes minutes on 2 cores. 8
    # heads (Llama: 4 key-value heads) so that tp=2 splits both evenly.
    "bench": Size(vocab=4096, seq=64, width=256, layers=4, heads=8),
    "tiny": Size(vocab=64, seq=16, width=32, layers=2, heads=4),
}
BACKENDS = ("gloo", "pycomm", "fake")
NPROC = 2


def _list(text: str, known: tuple[str, ...], what: str) -> list[str]:
    items = text.split(",")
    if bad := [i for i in items if i not in known]:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {list(known)}")
    return items


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step_time",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", type=lambda s: _list(s, ("gpt", "llama"), "models"),
                   default=["gpt", "llama"])
    p.add_argument("--layouts", type=lambda s: _list(s, LAYOUTS, "layouts"),
                   default=list(LAYOUTS))
    p.add_argument("--threads", type=lambda s: _list(s, ("1", "default"), "threads"),
                   default=["1", "default"])
    p.add_argument("--backends", type=lambda s: _list(s, BACKENDS, "backends"),
                   default=list(BACKENDS))
    p.add_argument("--size", choices=sorted(SIZES), default="bench")
    p.add_argument("--steps", type=int, default=3, help="timed steps per cell per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="global sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: size's)")
    p.add_argument("--jobs", type=int, default=1, help="fresh jobs; cells: median over them")
    p.add_argument("--out", type=Path, default=Path("bench/out/step_time.json"))
    args = p.parse_args(argv)
    if args.batch % NPROC:
        p.error(f"--batch must be even: dp splits it over {NPROC} ranks, pp into 2 micro-batches")
    size = SIZES[args.size]
    args.model_size = Size(size.vocab, args.seq or size.seq, size.width, size.layers,
                           size.heads)
    return args


def run_jobs(args: argparse.Namespace) -> dict[tuple[str, str, str], list[list[dict[str, Any]]]]:
    """Each (model, layout, threads)'s per-rank results, one entry per job (a failed job: a
    reason for all its cells)."""
    timing = Timing(args.steps, args.rounds, args.warmup)
    out: dict[tuple[str, str, str], list[list[dict[str, Any]]]] = {}
    for job in range(args.jobs):
        for model in args.models:
            for layout in args.layouts:
                for threads in args.threads:
                    key = (model, layout, threads)
                    print(f"# job {job + 1}/{args.jobs}: {model} {layout} threads={threads}",
                          file=sys.stderr, flush=True)
                    out.setdefault(key, []).append(_job(args, key, timing))
    return out


def _job(args: argparse.Namespace, key: tuple[str, str, str], timing: Timing
         ) -> list[dict[str, Any]]:
    """One fresh set of ranks timing every backend of (model, layout, threads); a job
    that fails: one entry with its reason. Threads are set per job, before torch's pool
    first runs (run_ranks applies PYCOMM_TEST_THREADS): "default" = torch's own count."""
    model, layout, threads = key
    count = 1 if threads == "1" else DEFAULT_THREADS
    work = Work(model, args.model_size, args.batch)
    try:
        return run_ranks(time_cells, NPROC, work, layout, args.backends, timing,
                         timeout_s=3600.0, env={"PYCOMM_TEST_THREADS": str(count)})
    except Exception as exc:  # RankFailure: every rank's error, last line first
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return [{"job_error": lines[-1] if lines else type(exc).__name__}]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _job_rounds(ranks: list[dict[str, Any]], cell: str) -> list[float]:
    """Each round's median over steps of the slowest rank's step time, in ms."""
    per_rank = [r["rounds_s"][cell] for r in ranks]
    return [statistics.median(max(s) * 1e3 for s in zip(*rounds, strict=True))
            for rounds in zip(*per_rank, strict=True)]


def _cell(jobs: list[list[dict[str, Any]]], cell: str) -> dict[str, Any]:
    """One row's step time (over rounds, or over jobs), or why it has none."""
    medians, reasons, counts = [], [], set()
    spread: dict[str, float] = {}
    for ranks in jobs:
        if "job_error" in ranks[0]:
            reasons.append(f"job failed: {ranks[0]['job_error']}")
        elif cell in ranks[0]["rounds_s"]:
            spread = _spread(_job_rounds(ranks, cell))
            medians.append(spread["median"])
            counts |= {r["threads"] for r in ranks}
        else:
            reasons.append(ranks[0]["reasons"].get(cell, "no timed rounds"))
    if not medians:
        return {"reason": reasons[0]}
    row: dict[str, Any] = {"step_ms": spread if len(jobs) == 1 else _spread(medians),
                           "jobs_ok": len(medians), "rank_threads": sorted(counts)}
    if reasons:
        row["reason"] = f"{len(reasons)} of {len(jobs)} jobs: {reasons[0]}"
    return row


def summarize(args: argparse.Namespace, results: dict) -> list[dict[str, Any]]:
    """The table's rows, with exposed comm and the pycomm/gloo ratio filled in."""
    rows = []
    for (model, layout, threads), jobs in results.items():
        cells = {b: _cell(jobs, b) for b in args.backends}
        fake = cells.get("fake", {}).get("step_ms", {}).get("median")
        gloo = cells.get("gloo", {}).get("step_ms", {}).get("median")
        for b, c in cells.items():
            ms = c.get("step_ms", {}).get("median")
            c["exposed_ms"] = None if ms is None or fake is None else ms - fake
            c["pycomm_over_gloo"] = (ms / gloo if b == "pycomm" and ms and gloo else None)
            rows.append({"model": model, "layout": layout, "threads": threads,
                         "backend": b, **c})
    return rows


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]], meta: dict) -> None:
    s = args.model_size
    print(f"# bench.step_time: {NPROC} ranks, batch {args.batch} x {s.seq} tokens, vocab "
          f"{s.vocab}, width {s.width}, {s.layers} layers, {s.heads} heads; params "
          f"{meta['params']}; AdamW; {args.rounds} rounds x {args.steps} steps per cell "
          f"(+{args.warmup} warmup), {args.jobs} job(s); threads default = "
          f"{DEFAULT_THREADS}; step = slowest rank, median [min-max] over "
          f"{'rounds' if args.jobs == 1 else 'jobs'}; exposed = step - fake step")
    print("| model | layout | threads | backend | step ms | exposed comm ms | pycomm/gloo |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['model']} | {r['layout']} | {r['threads']} | {r['backend']} |"
        if "step_ms" not in r:
            print(f"{head} - ({r['reason']}) | - | - |")
            continue
        st = r["step_ms"]
        note = f" ({r['reason']})" if "reason" in r else ""
        print(f"{head} {st['median']:.1f} [{st['min']:.1f}-{st['max']:.1f}]{note} | "
              f"{_num(r['exposed_ms'])} | {_num(r['pycomm_over_gloo'], '.3f')} |")


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    """What the JSON needs to be read later."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    params = {m: sum(p.numel() for p in build(m, 0, args.model_size).parameters())
              for m in args.models}
    return {"torch": torch.__version__, "commit": head, "date": now(),
            "loadavg": list(os.getloadavg()), "cpu_count": os.cpu_count(),
            "default_threads": DEFAULT_THREADS, "params": params,
            # OMP_WAIT_POLICY above all: libgomp's spinning threads of 2 ranks x default
            # threads on 2 cores made GPT's default-thread step ~20x slower than passive.
            "env": environment()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    meta = metadata(args)  # load average before the run loads the machine
    results = run_jobs(args)
    rows = summarize(args, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    flags = {k: str(v) if isinstance(v, (Path, Size)) else v for k, v in vars(args).items()}
    # raw: per (model, layout, threads), per job, every rank's step seconds per round
    raw = {"|".join(key): jobs for key, jobs in results.items()}
    args.out.write_text(json.dumps({**meta, "args": flags, "rows": rows, "raw": raw}, indent=1))
    print_table(args, rows, meta)
    print(f"# wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
