"""The README's headline figure: all_reduce busbw and small-size latency per backend,
the median over one or more fresh `python -m bench.collectives` jobs.

    python -m bench.headline [JSON ...] --out docs/headline.png
    python -m bench.headline --summary records/collectives/mpirun-2r-fp32-barrier.json

Each JSON is one job's `bench/out/collectives.json` (copy it aside between jobs).
With several, every point is the median across the jobs and its error bar spans their
minimum to maximum; the jobs must agree on ranks and dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench import _best
from bench._report import LATENCY_MAX
from bench._timing import busbw_gbs
from pycomm.parallel._optional import available, note

DEFAULT_JSON = Path("bench/out/collectives.json")
DEFAULT_OUT = Path("docs/headline.png")
README_SUMMARY = Path("records/collectives/mpirun-2r-fp32-barrier.json")

# one backend's curve: (bytes, median, min, max) per size, sizes ascending
Curve = list[tuple[int, float, float, float]]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of one point's readings, one per job."""
    if not values:
        raise ValueError("spread of no readings")
    return statistics.median(values), min(values), max(values)


def aggregate(runs: Sequence[Sequence[dict]], op: str, field: str) -> dict[str, Curve]:
    """Per backend, `field` ("busbw" or "time_us") of `op` at each size across the runs.

    A run is one job's result rows; backends keep the order they first appear in.
    A size a job did not measure for a backend simply has fewer readings there.
    """
    readings: dict[str, dict[int, list[float]]] = {}
    for rows in runs:
        for row in rows:
            if row["op"] == op:
                per_size = readings.setdefault(row["backend"], {})
                per_size.setdefault(row["bytes"], []).append(float(row[field]))
    return {
        backend: [(n, *spread(vals)) for n, vals in sorted(per_size.items())]
        for backend, per_size in readings.items()
    }


def load(paths: Sequence[Path]) -> tuple[dict, list[list[dict]]]:
    """The first job's meta and every job's rows; jobs of other ranks or dtype are refused."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    first = docs[0]["meta"]
    for path, doc in zip(paths, docs, strict=True):
        meta = doc["meta"]
        for key in ("nproc", "datatype"):
            if meta.get(key) != first.get(key):
                raise ValueError(
                    f"{path}: {key}={meta.get(key)!r} but {paths[0]}: {key}={first.get(key)!r};"
                    " a headline median mixes only jobs of the same ranks and dtype"
                )
    return first, [doc["results"] for doc in docs]


def best_rows(docs: Sequence[dict]) -> list[dict]:
    """One job's rows, one per backend family at its best setting (bench._best)."""
    world = docs[0]["meta"]["nproc"]
    return [{"op": op, "backend": fam, "bytes": n, "time_us": t,
             "busbw": busbw_gbs(op, n, t, world)}
            for (op, fam, n), (t, _) in _best.best_of_job(list(docs)).items()
            if "#" not in fam]


def load_summary(path: Path) -> tuple[dict, list[list[dict]]]:
    """A ``--jobs`` summary's meta and, per job, its best-of-family rows, read from the
    raw files the summary lists (committed beside it)."""
    summary = json.loads(Path(path).read_text())
    if not summary.get("runs"):
        raise ValueError(f"{path}: no 'runs' (a summary written before they were listed)")
    jobs = [[json.loads((Path(path).parent / name).read_text()) for name in names]
            for names in summary["runs"]]
    return summary["meta"], [best_rows(docs) for docs in jobs]


def title(meta: dict, jobs: int, op: str) -> str:
    """`all_reduce, 2 ranks, float32, median of 3 jobs (bars: min-max)`."""
    what = f"{op}, {meta.get('nproc', '?')} ranks, {meta.get('datatype', '?')}"
    if jobs == 1:
        return f"{what}, one job"
    return f"{what}, median of {jobs} jobs (bars: min-max)"


def _draw(ax, curves: dict[str, Curve], colours: dict[str, str], max_bytes: int | None) -> None:
    for backend, curve in curves.items():
        pts = [p for p in curve if max_bytes is None or p[0] <= max_bytes]
        if not pts:
            continue
        sizes = [p[0] for p in pts]
        med = [p[1] for p in pts]
        below = [p[1] - p[2] for p in pts]
        above = [p[3] - p[1] for p in pts]
        ax.errorbar(sizes, med, yerr=[below, above], marker="o", capsize=3,
                    label=backend, color=colours[backend])


def plot(meta: dict, runs: list[list[dict]], out: Path, op: str = "all_reduce") -> bool:
    """Write the two-panel PNG; False (nothing written) without matplotlib."""
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    busbw = aggregate(runs, op, "busbw")
    latency = aggregate(runs, op, "time_us")
    colours = {b: f"C{i}" for i, b in enumerate(busbw)}
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    _draw(bw_ax, busbw, colours, None)
    _draw(lat_ax, latency, colours, LATENCY_MAX)
    bw_ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s), higher is better",
              title="bus bandwidth")
    lat_ax.set(xscale="log", yscale="log", xlabel="message size (bytes)",
               ylabel="time (µs), lower is better", title="latency up to 64 KB")
    for ax in (bw_ax, lat_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title(meta, len(runs), op))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", type=Path, default=[DEFAULT_JSON],
                    help=f"bench.collectives JSON files, one per job (default {DEFAULT_JSON})")
    ap.add_argument("--summary", type=Path, default=None,
                    help="a --jobs summary: plot every backend at its best setting per job, "
                    "from the raw files it lists (the README's figure: "
                    f"{README_SUMMARY})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG (default {DEFAULT_OUT})")
    ap.add_argument("--op", default="all_reduce", help="the collective to plot")
    ap.add_argument("--backends", default="", help="comma list of the backends to draw "
                    "(default: every one; e.g. leave out an A/A column such as pycomm#2)")
    args = ap.parse_args(argv)
    meta, runs = load_summary(args.summary) if args.summary else load(args.json)
    if args.backends:
        keep = set(args.backends.split(","))
        runs = [[r for r in rows if r["backend"] in keep] for rows in runs]
    if not any(r["op"] == args.op for rows in runs for r in rows):
        ap.error(f"no {args.op} rows in {', '.join(map(str, args.json))}")
    if not plot(meta, runs, args.out, args.op):
        ap.error(note("matplotlib", "plot"))
    print(f"{title(meta, len(runs), args.op)} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
