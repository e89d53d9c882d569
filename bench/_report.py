"""Turn per-rank timings into nccl-tests style rows, a printed table, JSON and a plot."""

import json
import statistics
from pathlib import Path

from bench._timing import REDUCING, busbw_factor
from pycomm.parallel._optional import available

GB = 1e9


def summarize(
    op: str,
    backend: str,
    nbytes: int,
    count: int,
    dtype: str,
    redop: str,
    per_rank: list[dict],
    world: int,
) -> dict:
    """One row: median over iterations of the slowest rank's time, and its bandwidths.

    ``per_rank[r]`` is what :func:`bench._timing.time_case` returned on rank r.
    """
    slowest = [max(it) for it in zip(*(r["times"] for r in per_rank), strict=True)]
    t = statistics.median(slowest)
    algbw = nbytes / t / GB
    wrong = [r["wrong"] for r in per_rank]
    return {
        "op": op,
        "backend": backend,
        "bytes": nbytes,
        "count": count,
        "type": dtype,
        "redop": redop if op in REDUCING else "none",
        "time_us": t * 1e6,
        "algbw": algbw,
        "busbw": algbw * busbw_factor(op, world),
        "wrong": -1 if min(wrong) < 0 else sum(wrong),
        "times_us": [s * 1e6 for s in slowest],
    }


def _cells(row: dict | None) -> str:
    """time(us) algbw busbw #wrong for one backend, or a dash row when it is missing."""
    if row is None:
        return f"{'-':>10} {'-':>7} {'-':>7} {'-':>6}"
    wrong = "N/A" if row["wrong"] < 0 else str(row["wrong"])
    return f"{row['time_us']:10.1f} {row['algbw']:7.3f} {row['busbw']:7.3f} {wrong:>6}"


def _ratio(a: dict | None, b: dict | None, width: int) -> str:
    """time and busbw of ``a`` over ``b`` (e.g. pycomm/gloo), blank when one is missing."""
    if a is None or b is None:
        return f"| {'':>{width}} "
    bus = a["busbw"] / b["busbw"] if b["busbw"] else float("nan")
    pair = f"{a['time_us'] / b['time_us']:6.2f} {bus:6.2f}"
    return f"| {pair:>{width}} "


def format_op(op: str, rows: list[dict], backends: list[str],
              limits: dict[int, float] | None = None) -> list[str]:
    """The table for one op: a header, one line per size, an average line per backend.

    After the backends' columns comes one ratio pair (time, busbw) of the first
    backend over each other one: pycomm/gloo, pycomm/mpi, ... and then, with
    ``limits`` ({bytes: busbw}), the limit busbw at each size (see limit_busbw).
    """
    limits = limits or {}
    by_key = {(r["bytes"], r["backend"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    ratios = [f"{backends[0]}/{b}" for b in backends[1:]]
    widths = [max(13, len(r)) for r in ratios]
    lines = [
        f"# op: {op}",
        "#" + " " * 40 + "".join(f"| {b:^33} " for b in backends)
        + "".join(f"| {r:^{w}} " for r, w in zip(ratios, widths, strict=True)),
        f"# {'size':>10} {'count':>11} {'type':>8} {'redop':>6} "
        + "| {:>10} {:>7} {:>7} {:>6} ".format("time(us)", "algbw", "busbw", "#wrong")
        * len(backends)
        + "".join(f"| {'time  busbw':>{w}} " for w in widths)
        + ("| limit" if limits else ""),
    ]
    for size in sizes:
        cols = [by_key.get((size, b)) for b in backends]
        first = next(c for c in cols if c is not None)
        line = (
            f"  {size:>10} {first['count']:>11} {first['type']:>8} {first['redop']:>6} "
            + "".join(f"| {_cells(c)} " for c in cols)
            + "".join(_ratio(cols[0], c, w) for c, w in zip(cols[1:], widths, strict=True))
            + (f"| {limits[size]:5.2f}" if size in limits else "")
        )
        lines.append(line.rstrip())
    for b in backends:
        lines.append(f"# Avg bus bandwidth    : {average_busbw(rows, b):8.4f}  ({b}, GB/s)")
    return [line.rstrip() for line in lines]


def average_busbw(rows: list[dict], backend: str) -> float:
    """Mean busbw over sizes, as nccl-tests' closing line."""
    vals = [r["busbw"] for r in rows if r["backend"] == backend]
    return sum(vals) / len(vals) if vals else float("nan")


def write_json(path: Path, meta: dict, rows: list[dict], limit: dict) -> None:
    """Machine-readable results beside the table (one object: meta, rows, averages)."""
    ops = sorted({r["op"] for r in rows})
    avg = {
        op: {b: average_busbw([r for r in rows if r["op"] == op], b) for b in meta["backends"]}
        for op in ops
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in meta.items()}
    doc = {"meta": meta, "results": rows, "avg_busbw": avg, "limit": limit}
    path.write_text(json.dumps(doc, indent=1))


LATENCY_MAX = 64 << 10  # the latency panel's largest size: where time, not bandwidth, rules


def write_plot(
    path: Path, rows: list[dict], backends: list[str], limits: dict[str, dict[int, float]],
    world: int,
) -> bool:
    """Per op, two panels: busbw against size (log-x, with the op's limit at each size,
    see limit_busbw) and time against size up to 64 KB (log-log), one line per backend.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(ops), 2, figsize=(12, 4 * len(ops)), squeeze=False)
    for (bw_ax, lat_ax), op in zip(axes, ops, strict=True):
        for i, b in enumerate(backends):
            mine = sorted(
                ((r["bytes"], r) for r in rows if r["op"] == op and r["backend"] == b),
                key=lambda nr: nr[0],
            )
            # a backend keeps its colour in every panel, even where another one is missing
            style = {"marker": "o", "label": b, "color": f"C{i}"}
            if mine:
                bw_ax.plot([n for n, _ in mine], [r["busbw"] for _, r in mine], **style)
            small = [(n, r["time_us"]) for n, r in mine if n <= LATENCY_MAX]
            if small:
                lat_ax.plot(*zip(*small, strict=True), **style)
        if limits.get(op):
            pts = sorted(limits[op].items())
            bw_ax.plot([n for n, _ in pts], [v for _, v in pts], color="grey", linestyle="--",
                       label="limit (least traffic at measured rates)")
        bw_ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)")
        bw_ax.set_title(f"{op}, {world} ranks: bus bandwidth")
        lat_ax.set(xscale="log", yscale="log", xlabel="size (bytes)", ylabel="time (µs)")
        lat_ax.set_title(f"{op}, {world} ranks: latency up to 64 KB")
        for ax in (bw_ax, lat_ax):
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
