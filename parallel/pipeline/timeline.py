"""The GPipe figure from a trace: stages as rows, forward and backward boxes over time."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._optional import available
from .pipeline import Event


def idle_fractions(events: Sequence[Event]) -> dict[int, float]:
    """Per stage: the share of the step (first start to last end over all stages) in
    which it ran no forward or backward: the bubble, plus communication it waited on."""
    start = min(e.start for e in events)
    span = max(e.end for e in events) - start
    busy: dict[int, float] = {}
    for e in events:
        busy[e.stage] = busy.get(e.stage, 0.0) + (e.end - e.start)
    return {stage: 1.0 - b / span for stage, b in sorted(busy.items())}


def plot_timeline(events: Sequence[Event], path: str | os.PathLike, title: str = "") -> bool:
    """Draw ``events`` (from ``Pipeline.gather_trace``) to a PNG; False without matplotlib."""
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = min(e.start for e in events)
    stages = sorted({e.stage for e in events})
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(stages)))
    for e in events:
        color = "tab:blue" if e.kind == "F" else "tab:orange"
        left, width = (e.start - start) * 1e3, (e.end - e.start) * 1e3
        ax.broken_barh([(left, width)], (e.stage - 0.4, 0.8), facecolors=color,
                       edgecolors="black", linewidth=0.3)
        ax.text(left + width / 2, e.stage, f"{e.kind}{e.micro}", ha="center", va="center",
                fontsize=6)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms); blue forward, orange backward, white the bubble")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
