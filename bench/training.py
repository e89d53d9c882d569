"""Training benchmarks: parallel strategies against their torch peers, in one run.

``python -m bench.training data`` times one SGD step of the project's GPT (``--model
bench``: ~20M parameters in 101 tensors, 2 sequences of 64 tokens per rank) for: the
same step without communication (``local``), torch DDP on gloo, torch DDP on pycomm (as
it is, and built and stepped in ``pycomm.use_arena()``: ``ddp-pycomm-arena``, its buckets
in the arena), and ``pycomm.parallel.data`` on pycomm (and on gloo), interleaved in rounds on the
same ranks.
Exposed communication = step time - local step time. Peak RSS comes from a fresh set of
ranks per strategy (and PSS after 3 steps, which counts shared memory once rather than
on every rank that maps it). The model is sized so communication matters: 80 MB of gradients
per step against a small per-rank batch, as in data parallelism at scale where the
per-rank batch shrinks as ranks are added.

``python -m bench.training zero`` times ZeRO stages 1, 2 and 3 (``pycomm.parallel.zero``) against
DDP, torch's ``ZeroRedundancyOptimizer`` (stage 1 peer) and FSDP2 ``fully_shard`` (stage 3
peer, per block and root) with AdamW, on pycomm and on gloo, with each ZeroOptimizer's
own accounting of parameter, gradient, state and bucket bytes; peak PSS is sampled
after each forward and backward. ``--strategies`` also takes the bf16 variants
``torch-fsdp2-bf16-*`` and ``parallel.zero3-bf16-*``.

``python -m bench.training buckets`` is the C_B micro-benchmark: the same model's
gradient tensors all-reduced one by one against in constant-size buckets.

Both print the table last and write JSON and a PNG next to ``-o``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench._bucket_bench import time_bucketing
from bench._pipeline_bench import PIPE_STRATEGIES
from bench._train_steps import (
    MIXED_STRATEGIES,
    STRATEGIES,
    TENSOR_STRATEGIES,
    ZERO_STRATEGIES,
    Setup,
    peak_memory,
    time_strategies,
)
from pycomm.parallel._optional import note
from pycomm.parallel.models import GPTConfig
from pycomm.testing import run_ranks

MODELS = {
    "bench": GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=6, n_embd=384),
    "tiny": GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32),
    # As "bench", with 8 heads so that TP = 2 and 4 both split them evenly.
    "tp": GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=384),
    "tiny-tp": GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32),
}
MB = 1e6


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["data", "buckets", "zero", "tensor", "pipeline"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="default: 'tp' for tensor (heads divisible by 4), else 'bench'")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--strategies", default=None, help="default: every strategy of `what`")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON path (PNG beside it)")
    p.add_argument("--width", type=int, default=1024, help="pipeline: the MLP's width")
    p.add_argument("--layers", type=int, default=8, help="pipeline: Linear + GELU pairs")
    p.add_argument("--rows", type=int, default=64, help="pipeline: rows per mini-batch")
    p.add_argument("--chunks", type=int, default=8, help="pipeline: micro-batches")
    p.add_argument("--memory-jobs", type=int, default=3,
                   help="pipeline: fresh jobs measuring each strategy's peak RSS; the median "
                   "of their largest rank is reported")
    p.add_argument("--bubble-jobs", type=int, default=5,
                   help="pipeline: fresh jobs measuring the bubble; the median is reported "
                   "(where the OS puts each stage varies per job, not per step)")
    args = p.parse_args(argv)
    args.out = args.out or Path("bench/out") / f"training_{args.what}_{args.nproc}ranks.json"
    args.model = args.model or ("tp" if args.what == "tensor" else "bench")
    default = {"zero": ZERO_STRATEGIES, "tensor": TENSOR_STRATEGIES,
               "pipeline": dict.fromkeys(PIPE_STRATEGIES)}.get(args.what, STRATEGIES)
    known = {**default, **MIXED_STRATEGIES} if args.what == "zero" else default
    args.strategies = args.strategies.split(",") if args.strategies else list(default)
    if unknown := set(args.strategies) - set(known):
        p.error(f"unknown strategies {sorted(unknown)}; choose from {list(known)}")
    return args


def _setup(args: argparse.Namespace) -> Setup:
    return Setup(MODELS[args.model], args.batch, args.steps, args.warmup, args.bucket_cap_mb,
                 args.rounds)


def _step_stats(per_rank: list[dict], name: str) -> dict[str, float]:
    """Median and quartiles of the slowest rank's time per step, in ms."""
    steps = zip(*(r[name]["times_s"] for r in per_rank), strict=True)
    slowest = sorted(max(s) * 1e3 for s in steps)
    q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else [slowest[0]] * 3
    return {"median_ms": statistics.median(slowest), "p25_ms": q[0], "p75_ms": q[2]}


def run_data(args: argparse.Namespace) -> dict[str, Any]:
    setup = _setup(args)
    timed = run_ranks(time_strategies, args.nproc, args.strategies, setup, timeout_s=3600.0)
    rows = {name: {**_step_stats(timed, name), "loss": timed[0][name]["loss"]}
            for name in args.strategies}
    if not args.no_memory:
        for name in args.strategies:
            mem = run_ranks(peak_memory, args.nproc, name, setup, timeout_s=600.0)
            rows[name]["peak_rss_mb"] = max(m["peak_rss_bytes"] for m in mem) / MB
            rows[name]["pss_mb"] = max(m["pss_bytes"] for m in mem) / MB
            rows[name]["peak_pss_mb"] = max(m["peak_pss_bytes"] for m in mem) / MB
            rows[name]["param_mb"] = mem[0]["param_bytes"] / MB
            arena = mem[0]["grad_arena_bytes"]
            rows[name]["grad_arena_mb"] = arena / MB if arena is not None else None
            if mem[0]["zero_memory"] is not None:
                rows[name]["zero_memory"] = mem[0]["zero_memory"]
    local = rows.get("local", {}).get("median_ms")
    for row in rows.values():
        row["exposed_ms"] = row["median_ms"] - local if local is not None else None
    return rows


def print_data(args: argparse.Namespace, rows: dict[str, Any]) -> None:
    cfg = MODELS[args.model]
    optim = "AdamW" if args.what == "zero" else "SGD momentum"
    if args.what == "tensor":
        optim = "SGD momentum; every rank of the TP group the same batch"
    print(f"# bench.training {args.what}: {args.nproc} ranks, GPT {cfg}, {args.batch} sequences "
          f"of {cfg.block_size} tokens per rank, {optim}, bucket cap {args.bucket_cap_mb} MB; "
          f"{args.rounds} rounds x {args.steps} steps per strategy, interleaved; "
          "time = slowest rank per step, median (p25-p75)")
    width = max(22, *(len(n) for n in rows))
    print(f"{'strategy':<{width}} {'step ms':>9} {'p25-p75 ms':>15} {'exposed comm ms':>16} "
          f"{'peak RSS MB':>12} {'peak PSS MB':>12} {'param MB':>9} {'grad arena MB':>14} "
          f"{'loss':>9}")
    for name, r in rows.items():
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"
        pss = f"{r['peak_pss_mb']:.0f}" if "peak_pss_mb" in r else "-"
        arena = f"{r['grad_arena_mb']:.1f}" if r.get("grad_arena_mb") else "-"
        exposed = f"{r['exposed_ms']:.1f}" if r["exposed_ms"] is not None else "-"
        params = f"{r['param_mb']:.1f}" if "param_mb" in r else "-"
        print(f"{name:<{width}} {r['median_ms']:>9.1f} {r['p25_ms']:>7.1f}-{r['p75_ms']:<7.1f} "
              f"{exposed:>16} {rss:>12} {pss:>12} {params:>9} {arena:>14} {r['loss']:>9.5f}")
    _print_targets(rows)


def _print_zero_accounting(rows: dict[str, Any]) -> None:
    for name, r in rows.items():
        if m := r.get("zero_memory"):
            masters = f", fp32 masters {m['master_bytes'] / MB:.1f} MB" if m.get(
                "master_bytes") else ""
            print(f"# {name}: params {m['param_bytes'] / MB:.1f} MB{masters}, grads "
                  f"{m['grad_bytes'] / MB:.1f} MB, optimizer state "
                  f"{m['optimizer_state_bytes'] / MB:.1f} MB, "
                  f"buckets/gathered units {m['bucket_bytes'] / MB:.1f} MB")


def _print_stage3_targets(rows: dict[str, Any]) -> None:
    for suffix in ("", "-bf16"):
        for group in ("pycomm", "gloo"):
            ours = rows.get(f"parallel.zero3{suffix}-{group}")
            peer = rows.get(f"torch-fsdp2{suffix}-{group}")
            if not (ours and peer):
                continue
            line = f"# {group}{suffix}: parallel.zero3 / torch-fsdp2: step time " \
                   f"{ours['median_ms'] / peer['median_ms']:.3f}"
            for key, what in (("peak_rss_mb", "peak RSS"), ("peak_pss_mb", "peak PSS")):
                if key in ours and key in peer:
                    line += f", {what} {ours[key] / peer[key]:.3f}"
            print(line + " (targets <= 1)")


def _print_tensor_targets(rows: dict[str, Any]) -> None:
    peer = rows.get("dtensor-tp-gloo")
    for name in ("parallel.tensor-pycomm", "parallel.tensor-sp-pycomm"):
        if (ours := rows.get(name)) and peer:
            ratio = ours["median_ms"] / peer["median_ms"]
            print(f"# step time, {name} / dtensor-tp-gloo: {ratio:.3f} (target < 1)")
    whole = rows.get("unsharded", {}).get("param_mb")
    for name, r in rows.items():
        if whole and name != "unsharded" and "param_mb" in r:
            print(f"# parameters per rank, {name} / unsharded: {r['param_mb'] / whole:.3f}")


def _print_targets(rows: dict[str, Any]) -> None:
    _print_zero_accounting(rows)
    _print_stage3_targets(rows)
    _print_tensor_targets(rows)
    ours, gloo, ddp = (rows.get(n) for n in ("parallel.data-pycomm", "ddp-gloo", "ddp-pycomm"))
    if ours and gloo and ours["exposed_ms"] is not None and gloo["exposed_ms"]:
        ratio = ours["exposed_ms"] / gloo["exposed_ms"]
        print(f"# exposed comm, parallel.data-pycomm / ddp-gloo: {ratio:.3f} (target <= 0.333)")
    if ours and ddp:
        ratio = ours["median_ms"] / ddp["median_ms"]
        print(f"# step time, parallel.data-pycomm / ddp-pycomm: {ratio:.3f} (target <= 1)")


def print_buckets(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(f"# bench.training buckets: {args.nproc} ranks, the GPT '{args.model}' gradients, "
          f"bucket cap {args.bucket_cap_mb} MB, median of {args.steps * args.rounds} "
          "interleaved iterations (slowest rank)")
    print(f"{'backend':<8} {'tensors':>8} {'buckets':>8} {'MB':>7} {'one by one ms':>14} "
          f"{'bucketed ms':>12} {'speed-up':>9}")
    for name, r in res.items():
        print(f"{name:<8} {r['tensors']:>8} {r['buckets']:>8} {r['bytes'] / MB:>7.1f} "
              f"{r['one_by_one_s'] * 1e3:>14.2f} {r['bucketed_s'] * 1e3:>12.2f} "
              f"{r['one_by_one_s'] / r['bucketed_s']:>8.2f}x")


def run_buckets(args: argparse.Namespace) -> dict[str, Any]:
    iters = args.steps * args.rounds
    per_rank = run_ranks(time_bucketing, args.nproc, MODELS[args.model], args.bucket_cap_mb,
                         iters, ["pycomm", "gloo"], timeout_s=3600.0)
    slowest = {}
    for name in per_rank[0]:
        slowest[name] = {**per_rank[0][name]}
        for key in ("one_by_one_s", "bucketed_s"):
            slowest[name][key] = max(r[name][key] for r in per_rank)
    return slowest


def write_outputs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "results": results}, indent=1))
    from bench._train_plot import plot

    png = args.out.with_suffix(".png")
    wrote = plot(args.what, results, png)
    print(f"# wrote {args.out}" + (f" and {png}" if wrote else f" ({note('matplotlib', 'plot')})"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.what == "pipeline":
        from bench._pipeline_report import print_pipeline, run_pipeline, write_pipeline

        res = run_pipeline(args)
        write_pipeline(args, res)
        print_pipeline(args, res)
    elif args.what in ("data", "zero", "tensor"):
        rows = run_data(args)
        write_outputs(args, rows)
        print_data(args, rows)
    else:
        res = run_buckets(args)
        write_outputs(args, res)
        print_buckets(args, res)


if __name__ == "__main__":
    main()
