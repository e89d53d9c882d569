"""What parallel.ps sends: bytes per worker step for sparse logistic regression.

``python -m bench.ps_traffic`` runs ``pycomm.parallel.ps.examples.logreg`` (BSP, 4 workers,
2 servers) and reads the pushed and pulled bytes each worker step reports.

1. Sparsity: at a few densities, bytes per step against the rows the step touched
   (the batch's distinct features, recomputed from the same seeded data) and against a
   dense exchange of every feature (features x 4 bytes, pushed and pulled: x 2).
2. Filters (at one density): the value codecs none / fp16 / int8, and the significance
   filter's threshold 0 against a few values: bytes per step saved, and the final
   held-out loss's change, against the unfiltered run.

Writes traffic.md, traffic.json and traffic.png under ``--out``; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.ps_consistency import final_loss, load, read_lines, run_logreg, steps_of
from pycomm.parallel._optional import available

Row = dict[str, Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ps_traffic",
                                description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--features", type=int, default=10**6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--densities", default="1e-5,1e-4,1e-3")
    p.add_argument("--density-steps", type=int, default=10, help="steps per density run")
    p.add_argument("--filter-density", type=float, default=1e-4)
    p.add_argument("--filter-steps", type=int, default=40, help="steps per filter run "
                   "(enough for the loss to settle, so its change means something)")
    p.add_argument("--codecs", default="none,fp16,int8")
    p.add_argument("--thresholds", default="1e-3,2e-3,5e-3", help="significance filter "
                   "thresholds besides 0 (a step's gradient rows start at 0.5/256 ~ 2e-3 "
                   "for a feature seen once)")
    p.add_argument("--out", type=Path, default=Path("records/ps"))
    return p.parse_args(argv)


def job(args: argparse.Namespace, name: str, density: float, steps: int,
        extra: list[str]) -> list[Row]:
    flags = ["--servers", str(args.servers), "--workers", str(args.workers),
             "--consistency", "bsp", "--features", str(args.features), "--density",
             str(density), "--steps", str(steps), "--batch-size", str(args.batch_size), *extra]
    metrics = args.out / "metrics" / f"traffic-{name}.jsonl"
    run_logreg(flags, metrics)
    print(f"{name}: done", flush=True)
    return read_lines(metrics)


def touched_rows(args: argparse.Namespace, density: float, steps: list[Row]) -> list[int]:
    """Each step line's distinct features (the rows it pulled and pushed), from the data."""
    from pycomm.parallel.ps.examples.ctr_data import ClickData

    data = ClickData(num_features=args.features, density=density, seed=0)
    return [len(data.batch(r["worker"], r["step"], args.batch_size).keys) for r in steps]


def sparsity(args: argparse.Namespace) -> list[Row]:
    rows = []
    dense = args.features * 4 * 2
    for density in [float(d) for d in args.densities.split(",") if d]:
        steps = steps_of(job(args, f"density-{density:g}", density, args.density_steps, []))
        moved = [r["pushed_bytes"] + r["pulled_bytes"] for r in steps]
        touched = touched_rows(args, density, steps)
        rows.append({"density": density, "touched_rows": statistics.median(touched),
                     "bytes_per_step": statistics.median(moved),
                     "bytes_per_row": statistics.median(
                         m / t for m, t in zip(moved, touched, strict=True)),
                     "dense_bytes": dense, "fraction_of_dense": statistics.median(moved) / dense})
    return rows


def filters(args: argparse.Namespace) -> list[Row]:
    cases = [(f"codec {c}", ["--codec", c]) for c in args.codecs.split(",") if c]
    cases += [(f"threshold {t}", ["--filter-threshold", t])
              for t in args.thresholds.split(",") if t]
    rows = []
    for name, extra in cases:
        lines = job(args, name.replace(" ", "-"), args.filter_density, args.filter_steps, extra)
        steps = steps_of(lines)
        rows.append({"case": name, "pushed": statistics.fmean(r["pushed_bytes"] for r in steps),
                     "pulled": statistics.fmean(r["pulled_bytes"] for r in steps),
                     "final_loss": final_loss(lines)})
    return rows


def tables(dense_rows: list[Row], filter_rows: list[Row]) -> list[str]:
    out = ["| density | touched rows / step (median) | bytes / step (pushed + pulled) | "
           "bytes / touched row | dense exchange (bytes) | sparse / dense |",
           "|---|---|---|---|---|---|"]
    for r in dense_rows:
        out.append(f"| {r['density']:g} | {r['touched_rows']:.0f} | {r['bytes_per_step']:.0f} | "
                   f"{r['bytes_per_row']:.2f} | {r['dense_bytes']} | "
                   f"{r['fraction_of_dense']:.2%} |")
    base = filter_rows[0]
    out += ["", "| filter | pushed B / step | pulled B / step | total saved vs none | pushed "
            "saved | final loss | loss change vs none |", "|---|---|---|---|---|---|---|"]
    for r in filter_rows:
        total, base_total = r["pushed"] + r["pulled"], base["pushed"] + base["pulled"]
        out.append(f"| {r['case']} | {r['pushed']:.0f} | {r['pulled']:.0f} | "
                   f"{1 - total / base_total:.1%} | {1 - r['pushed'] / base['pushed']:.1%} | "
                   f"{r['final_loss']:.4f} | "
                   f"{(r['final_loss'] - base['final_loss']) / base['final_loss']:+.2%} |")
    return out


def plot(dense_rows: list[Row], path: Path) -> bool:
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["touched_rows"] for r in dense_rows]
    ax.loglog(xs, [r["bytes_per_step"] for r in dense_rows], "o-", label="parallel.ps (sparse)")
    ax.loglog(xs, [r["dense_bytes"] for r in dense_rows], "s--", label="dense: features x 4 B x 2")
    for r in dense_rows:
        ax.annotate(f"density {r['density']:g}", (r["touched_rows"], r["bytes_per_step"]),
                    textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set_xlabel("touched rows per worker step")
    ax.set_ylabel("bytes per worker step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


EXPLAIN = """\
Every byte counted is a tensor frame: a pull sends the keys (8 B each) and receives one
float32 per key; a push sends keys and values (none: 4 B, fp16: 2 B, int8: 1 B plus a
float32 scale per 256 values). So one touched row costs 8 + 4 pulled and 8 + 4 pushed
= 24 B, plus 24 B for the bias, and a step's bytes follow its touched rows, not the
feature count; a dense exchange would move every feature's float both ways. The codecs
shrink only the pushed values, so the 8-byte keys (2/3 of a raw push) bound their saving.
The significance filter holds back rows whose |gradient| is below the threshold and adds
them to the key's next push (error feedback): a held row saves its 8 + 4 pushed bytes,
while the pull still fetches every touched row. What is still held after the last step
is pushed before the final loss is measured, so the filter delays gradient mass but
drops none. Headers (JSON) are not counted."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load()
    dense_rows, filter_rows = sparsity(args), filters(args)
    setup = (f"BSP, {args.workers} workers, {args.servers} servers, {args.features} features, "
             f"batch {args.batch_size} per worker, lr 0.3; densities run "
             f"{args.density_steps} steps, filters {args.filter_steps} steps at density "
             f"{args.filter_density:g}")
    md = ["# parallel.ps traffic (bench/ps_traffic.py)", "",
          f"Setup: {setup}. Load average before: {load_before}; after: {load()}.", "",
          *tables(dense_rows, filter_rows), "", EXPLAIN, ""]
    (args.out / "traffic.md").write_text("\n".join(md))
    (args.out / "traffic.json").write_text(json.dumps(
        {"setup": setup, "sparsity": dense_rows, "filters": filter_rows}, indent=1))
    plot(dense_rows, args.out / "traffic.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
