"""The loss curve of a run (training loss per step, validation loss per evaluation)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .._optional import available


def loss_curve(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Draw the train and val losses of ``records`` (metrics lines) into the PNG ``path``;
    False without matplotlib (an optional dependency)."""
    matplotlib = available("matplotlib")
    if matplotlib is None:  # pragma: no cover - the test environment has matplotlib
        return False

    matplotlib.use("Agg")  # no display: ranks and CI have none
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val (held-out batches)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
