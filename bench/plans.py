"""``python -m bench.plans``: every model of the zoo in every layout, against one process.

For each model (the project's GPT, HuggingFace Llama, Qwen2, Mistral and GPT-2, a
user's block with ``nn.MultiheadAttention`` under a user plan, a plain MLP), each layout
``DPxTPxPP`` and each ZeRO stage where dp > 1: 20 steps of the same AdamW recipe through
``parallelize``, and the largest relative difference of the loss (and of the gradient
norm) from one process built from the same weights. ``--precision bf16|fp16`` compares
against one process running the same precision recipe (and prints the distance to
fp32 beside it); ``--meta`` builds every model on the meta device (each rank then
materializes only what it holds; the reference materializes the whole model).

Example::

    python -m bench.plans --out records/model-plans/fp32.md
    python -m bench.plans --models gpt,llama --layouts 2x2x1 --precision bf16
    python -m bench.plans --layouts 2x2x1,1x2x2,2x2x2 \
        --config '{"sequence_parallel": true, "recompute": true}'
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import _model_zoo as zoo
from bench import _plan_runs as runs
from bench._provenance import cpu_model, git_commit, now, versions

DEFAULT_LAYOUTS = "4x1x1,2x2x1,2x1x2,1x2x2,1x1x4,2x2x2"


def _layouts(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        dp, tp, pp = (int(v) for v in item.lower().split("x"))
        out.append((dp, tp, pp))
    return out


def cases(models: list[str], layouts: list[tuple[int, int, int]],
          zero: list[int]) -> list[tuple[str, tuple[int, int, int], int]]:
    """(model, layout, ZeRO stage): ZeRO where dp > 1; the MLP without TP (it has no
    tensor-parallel plan: a TP layout refuses it, which tests show) or PP."""
    out = []
    for model in models:
        for lay in layouts:
            if model == "mlp" and (lay[1] > 1 or lay[2] > 1):
                continue
            for z in zero:
                if z == 0 or lay[0] > 1:
                    out.append((model, lay, z))
    return out


def _row(model: str, lay: tuple[int, int, int], z: int, got: Any, want: Any,
         fp32: Any, seconds: float) -> dict[str, Any]:
    rel = runs.relative(got, want)
    row: dict[str, Any] = {"model": model, "layout": "x".join(map(str, lay)), "zero": z,
                           "seconds": round(seconds, 1)}
    if isinstance(rel, str):
        return {**row, "error": rel.splitlines()[0]}
    row.update(loss_rel=rel[0], norm_rel=rel[1],
               skipped=sum(s for *_, s in got), ref_skipped=sum(s for *_, s in want))
    if fp32 is not None:
        row["loss_rel_fp32"] = runs.relative(got, fp32)[0]  # type: ignore[index]
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pycomm.testing import RankPool

    recipe = zoo.Recipe(steps=args.steps)
    todo = cases(args.models.split(","), _layouts(args.layouts), [int(z) for z in
                                                                  args.zero.split(",")])
    refs = {m: runs.one_process(m, recipe, args.precision, args.meta, args.loss_scale)
            for m in {c[0] for c in todo}}
    fp32 = ({m: runs.one_process(m, recipe) for m in refs} if args.precision != "fp32"
            else {m: None for m in refs})
    rows = []
    for world in sorted({lay[0] * lay[1] * lay[2] for _, lay, _ in todo}):
        with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
            for model, lay, z in [c for c in todo if c[1][0] * c[1][1] * c[1][2] == world]:
                config = {"zero": z, "precision": args.precision, "loss_scale": args.loss_scale,
                          **args.config}
                t0 = time.perf_counter()
                got = pool.run(runs.layout, model, *lay, config, recipe, args.meta,
                               timeout_s=900)[0]
                rows.append(_row(model, lay, z, got, refs[model], fp32[model],
                                 time.perf_counter() - t0))
                print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {row['model']} | {row['layout']} | {row['zero']} | refused: {row['error']} |"
    extra = (f" {row['loss_rel_fp32']:.1e} |" if "loss_rel_fp32" in row else "")
    skipped = f" {row['skipped']} / {row['ref_skipped']} |" if "loss_rel_fp32" in row else ""
    return (f"| {row['model']} | {row['layout']} | {row['zero']} | {row['loss_rel']:.1e} | "
            f"{row['norm_rel']:.1e} |{extra}{skipped}")


def _header(precision: str) -> str:
    if precision == "fp32":
        return ("| model | dp x tp x pp | ZeRO | max rel. loss diff | max rel. grad-norm diff |\n"
                "|---|---|---|---|---|")
    return ("| model | dp x tp x pp | ZeRO | max rel. loss diff (same recipe) | grad norm | "
            "against fp32 | skipped steps (layout / one process) |\n|---|---|---|---|---|---|---|")


def summary(rows: list[dict[str, Any]]) -> str:
    """The largest relative loss difference per model and layout, over its ZeRO stages
    (how many in brackets): the table's digest."""
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    lines = ["| model | " + " | ".join(layouts) + " |", "|---" * (len(layouts) + 1) + "|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for lay in layouts:
            got = [r for r in rows if r["model"] == model and r["layout"] == lay]
            bad = [r for r in got if "error" in r]
            worst = max((r["loss_rel"] for r in got if "error" not in r), default=None)
            cells.append("—" if not got else f"refused ({len(bad)})" if worst is None
                         else f"{worst:.1e} ({len(got)})")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plans", description=__doc__.split(
        "\n\n")[1])
    parser.add_argument("--models", default=",".join(zoo.ALL))
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    parser.add_argument("--zero", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--meta", action="store_true", help="build every model on meta")
    parser.add_argument("--loss-scale", type=float, default=2.0**22,
                        help="fp16's initial loss scale (high: the first steps overflow and "
                             "are skipped, as the table counts)")
    parser.add_argument("--config", type=json.loads, default={},
                        help='more ParallelConfig settings, as JSON: \'{"recompute": true}\'')
    parser.add_argument("--out", help="markdown table (and .json beside it)")
    parser.add_argument("--summarize", metavar="JSON", help="print the digest of a run's JSON")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summary(json.loads(Path(args.summarize).read_text())["rows"]))
        return
    print(_header(args.precision))
    rows = run(args)
    print(summary(rows))
    if args.out:
        table = "\n".join([_header(args.precision), *map(_line, rows)]) + "\n"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"argv": vars(args), "commit": git_commit(), "when": now(),
             "versions": versions(), "cpu": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
