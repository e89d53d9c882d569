"""``python -m bench.layouts``: the trainer on many layouts and ZeRO stages, against one process.

Each run is ``pycomm.parallel.train.launch`` itself (the trainer's code path, spawning its own
ranks), with dropout 0, the same seed, model and batches, writing its metrics lines; the
table then compares them. Layouts are written ``DPxTPxPP``, (dp, tp, pp) order, as the
trainer's flags: ``2x1x2`` is dp=2, tp=1, pp=2. By default: the one-process 1x1x1, every
4-rank layout (4x1x1, 2x2x1, 2x1x2, 1x2x2, 1x1x4) and the 8-rank 2x2x2, each with every
ZeRO stage where dp > 1 (ZeRO shards over dp).

Columns: the largest relative difference of a step's training loss from the one-process
run's; the mean step time of steps 2.. (step 1 builds lazily); the global batch's tokens
over that time; the largest peak RSS of any rank (the trainer's ``peak_rss_mb``). A run
that fails says why in its row (a ZeRO stage the engine does not offer yet, say).

Example::

    python -m bench.layouts --steps 10 --out bench/out/layouts.md
    python -m bench.layouts --layouts 2x2x1,1x1x4 --zero 0,1 --n-layer 8   # trainer flags too
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from pycomm.parallel.job.config import TrainConfig, parse
from pycomm.parallel.train.launch import launch
from pycomm.parallel.train.metrics import read_lines

DEFAULT_LAYOUTS = "4x1x1,2x2x1,2x1x2,1x2x2,1x1x4,2x2x2"
# The trainer's settings unless given: small enough for a few CPU cores, and every
# default layout divides it (4 heads, 4 blocks, 8 rows for dp=4 or 4 micro-batches).
BENCH_DEFAULTS = ["--n-layer", "4", "--n-head", "4", "--n-embd", "64", "--block-size", "64",
                  "--batch-size", "8", "--steps", "10", "--eval-every", "0"]


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"2x1x2"`` -> ``(dp, tp, pp)`` = ``(2, 1, 2)``."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"layouts: {text!r} is not DPxTPxPP (three positive ints, e.g. 2x1x2)")
    dp, tp, pp = (int(p) for p in parts)
    return dp, tp, pp


def plan(layouts: list[tuple[int, int, int]], zeros: list[int]) -> list[tuple[int, ...]]:
    """The runs, as ``(dp, tp, pp, zero)``: one process first, then each layout with each
    ZeRO stage where it has a data-parallel dimension to shard over."""
    runs = [(1, 1, 1, 0)]
    for dp, tp, pp in layouts:
        runs += [(dp, tp, pp, z) for z in (zeros if dp > 1 else [0])]
    return list(dict.fromkeys(runs))


def run_one(base: TrainConfig, dp: int, tp: int, pp: int, zero: int, out: Path
            ) -> list[dict[str, Any]] | str:
    """The trainer's metrics lines for one run, or why it failed."""
    metrics = out / f"{dp}x{tp}x{pp}-zero{zero}.jsonl"
    cfg = dataclasses.replace(base, dp=dp, tp=tp, pp=pp, zero=zero, nproc=0, dropout=0.0,
                              metrics=str(metrics), plot="", progress=False, resume=False,
                              ckpt_every=0)
    try:
        cfg.check()
        launch(cfg)
    except Exception as exc:  # a rank's failure arrives wrapped, traceback and all
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return lines[-1] if lines else type(exc).__name__
    return [r for r in read_lines(metrics) if r["kind"] == "train"]


def summarize(lines: list[dict[str, Any]], reference: list[dict[str, Any]] | None,
              tokens: int) -> dict[str, float]:
    """One row's numbers (see the module docstring)."""
    timed = [r["step_s"] for r in lines[1:]] or [lines[0]["step_s"]]
    mean_s = statistics.mean(timed)
    diff = float("nan")
    if reference is not None:
        diff = max(abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
                   for r, ref in zip(lines, reference, strict=True))
    return {"max_rel_diff": diff, "step_ms": mean_s * 1e3, "tokens_per_s": tokens / mean_s,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in lines)}


def table(rows: list[tuple[tuple[int, ...], dict[str, float] | str]]) -> str:
    """The Markdown table of every run."""
    out = ["| layout (dp x tp x pp) | ranks | ZeRO | max rel. loss diff vs 1 process | "
           "mean step (ms) | tokens/s | peak RSS, max over ranks (MB) |",
           "|---|---|---|---|---|---|---|"]
    for (dp, tp, pp, zero), row in rows:
        head = f"| {dp}x{tp}x{pp} | {dp * tp * pp} | {zero} |"
        if isinstance(row, str):
            out.append(f"{head} fails: {row} | | | |")
        else:
            out.append(f"{head} {row['max_rel_diff']:.1e} | {row['step_ms']:.1f} | "
                       f"{row['tokens_per_s']:.0f} | {row['peak_rss_mb']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.split("\n")[0],
                                epilog="Other flags go to the trainer (python -m "
                                "pycomm.parallel.train --help); dropout is always 0.")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="DPxTPxPP,... ((dp, tp, pp) order)")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages for layouts with dp > 1")
    p.add_argument("--out", type=Path, default=Path("bench/out/layouts.md"))
    args, trainer_flags = p.parse_known_args(argv)
    base = parse(BENCH_DEFAULTS + trainer_flags)
    runs = plan([parse_layout(t) for t in args.layouts.split(",")],
                [int(z) for z in args.zero.split(",")])
    rows: list[tuple[tuple[int, ...], dict[str, float] | str]] = []
    reference = None
    with tempfile.TemporaryDirectory(prefix="layouts-") as tmp:
        for run in runs:
            print(f"# {run[0]}x{run[1]}x{run[2]} zero={run[3]}", file=sys.stderr, flush=True)
            lines = run_one(base, *run, Path(tmp))
            if isinstance(lines, list) and reference is None:
                reference = lines  # the one-process run comes first
            rows.append((run, lines if isinstance(lines, str) else
                         summarize(lines, reference, base.batch_size * base.block_size)))
    text = f"{_setup_line(base)}\n\n{table(rows)}\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"# wrote {args.out}", file=sys.stderr)
    return 0


def _setup_line(cfg: TrainConfig) -> str:
    return (f"GPT n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
            f"block_size={cfg.block_size}, batch {cfg.batch_size}, {cfg.steps} steps, seed "
            f"{cfg.seed}, dropout 0, backend {cfg.backend}, {cfg.threads} thread(s) per rank")


if __name__ == "__main__":
    sys.exit(main())
