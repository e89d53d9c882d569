"""Bar charts for bench.training: step time split into compute and exposed communication,
or one-by-one against bucketed all-reduce time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pycomm.parallel._optional import available


def plot(what: str, results: dict[str, Any], path: Path) -> bool:
    """Write the chart for ``what`` ("data" or "buckets"); False without matplotlib."""
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    if what == "data":
        _data_bars(ax, results)
    elif what in ("zero", "tensor"):
        _zero_bars(ax, results)
    else:
        _bucket_bars(ax, results)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _data_bars(ax: Any, rows: dict[str, Any]) -> None:
    names = list(rows)
    local = rows.get("local", {}).get("median_ms", 0.0)
    compute = [min(local, r["median_ms"]) for r in rows.values()]
    exposed = [max(0.0, r["median_ms"] - local) for r in rows.values()]
    ax.barh(names, compute, label="step without communication")
    ax.barh(names, exposed, left=compute, label="exposed communication")
    ax.set_xlabel("step time (ms, median of the slowest rank)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")


def _zero_bars(ax: Any, rows: dict[str, Any]) -> None:
    """Step time per strategy, each bar labelled with its peak PSS (memory) if measured."""
    names = list(rows)
    bars = ax.barh(names, [r["median_ms"] for r in rows.values()])
    labels = [f"{r['peak_pss_mb']:.0f} MB peak PSS" if "peak_pss_mb" in r else ""
              for r in rows.values()]
    ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
    ax.set_xlabel("step time (ms, median of the slowest rank)")
    ax.invert_yaxis()


def _bucket_bars(ax: Any, res: dict[str, Any]) -> None:
    names = list(res)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["one_by_one_s"] * 1e3 for r in res.values()], 0.4,
           label="one collective per tensor")
    ax.bar([x + 0.2 for x in xs], [r["bucketed_s"] * 1e3 for r in res.values()], 0.4,
           label="bucketed (C_B)")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("all-reduce of every gradient (ms)")
    ax.set_yscale("log")
    ax.legend()
