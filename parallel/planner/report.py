"""The planner's table: one row per layout, its per-rank memory by term and its step
time, fitting layouts first by time."""

from __future__ import annotations

import json
from typing import Any

from .planner import Row

MIB = 1 << 20


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def row_dict(row: Row) -> dict[str, Any]:
    """Everything predicted for one layout (bytes and seconds), for --json."""
    w = row.worst
    settings = [f"--{k.replace('_', '-')}={v:g}" for k, v in row.settings.items()]
    return {"layout": str(row), "flags": row.layout.flags() + settings, "fits": row.fits,
            "peak_bytes": row.peak, "params": w.params, "grads": w.grads,
            "optimizer": w.optimizer, "buffers": dict(w.buffers), "experts": dict(w.experts),
            "activations": w.activations, "end_of_backward": w.end_of_backward,
            "step_pass": w.step_pass,
            "per_stage_peak_bytes": [m.peak for m in row.memory],
            "step_s": row.time.total, "time": vars(row.time)}


HEADER = ("| # | layout | params MiB | grads MiB | optimizer MiB | buffers MiB | "
          "activations (+ gradients in flight; offload: or its step pass) MiB | "
          "peak MiB | fits | step ms | "
          "compute / bubble / TP / PP / DP / EP / "
          "optimizer / I/O / waiting for peers ms |")


def table(rows: list[Row], top: int = 0) -> list[str]:
    """Markdown rows (the worst rank of each layout); ``top``: only the best N that fit."""
    shown = [r for r in rows if r.fits][:top] if top else rows
    out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for i, r in enumerate(shown, 1):
        w, t = r.worst, r.time
        held = {**w.buffers, "experts": sum(w.experts.values())}  # their params, grads, state
        buffers = ", ".join(f"{k} {_mib(v)}" for k, v in held.items() if v)
        parts = (t.compute, t.bubble, t.tensor_comm, t.pipeline_comm, t.data_comm,
                 t.expert_comm, t.optimizer, t.offload_io, t.sync_wait)
        cells = [str(i) if r.fits else "-", str(r), _mib(w.params), _mib(w.grads),
                 _mib(w.optimizer), buffers or "0",
                 _mib(max(w.activations, w.end_of_backward, w.step_pass)), _mib(r.peak),
                 "yes" if r.fits else "**no**", f"{t.total * 1e3:.1f}",
                 " / ".join(f"{x * 1e3:.1f}" for x in parts)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def write_json(path: str, rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump([row_dict(r) for r in rows], f, indent=1)
