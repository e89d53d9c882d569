"""The real-batch table: every model x case x layout of ``_real_batch_scenarios`` trained
``--steps`` steps against one process; prints the largest relative difference of the loss
and of the pre-clip gradient norm per cell, as Markdown, and writes them as JSON.

    python -m tests.real_batch_table --steps 20 --out records/real_batches/fp32.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from pycomm.testing import RankPool
from tests import _real_batch_scenarios as sc


def _commit() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip()


def measure(steps: int, dtype: str = "float32") -> dict[str, dict[str, list[float]]]:
    """layout -> "model/case" -> [loss difference, norm difference]; the first columns
    are one process against itself, accumulating over 2 and 4 chunks of rows (the fp32
    rounding's own spread)."""
    want = {(m, c): sc.one_process(m, c, steps, dtype=dtype)
            for m in sc.MODELS for c in sc.CASES}
    cells: dict[str, dict[str, list[float]]] = {}
    for chunks in (2, 4):
        cells[f"1 process, {chunks} chunks"] = {
            f"{m}/{c}": list(sc.worst_relative(sc.one_process(m, c, steps, chunks, dtype),
                                                 want[(m, c)]))
            for m, c in want}
    for world in sorted({sc.world_of(name) for name in sc.LAYOUTS}):
        with RankPool(world, backend="pycomm", pg_timeout_s=300) as pool:
            for layout in (n for n in sc.LAYOUTS if sc.world_of(n) == world):
                ranks = pool.run(sc.layout_curves, layout, sc.MODELS, sc.CASES, steps, dtype)
                cells[layout] = {
                    f"{m}/{c}": [max(sc.worst_relative(r[(m, c)], want[(m, c)])[i]
                                     for r in ranks) for i in (0, 1)]
                    for m, c in want}
    return cells


def markdown(cells: dict[str, dict[str, list[float]]]) -> str:
    layouts = list(cells)
    rows = ["| model / case | " + " | ".join(layouts) + " |",
            "|---|" + "---|" * len(layouts)]
    for key in next(iter(cells.values())):
        rows.append(f"| {key} | " + " | ".join(
            f"{cells[lay][key][0]:.1e} / {cells[lay][key][1]:.1e}" for lay in layouts) + " |")
    layouts_only = [lay for name, lay in cells.items() if not name.startswith("1 process")]
    worst = max(v for lay in layouts_only for pair in lay.values() for v in pair)
    return ("\n".join(rows)
            + f"\n\nlargest over the layouts: {worst:.1e} (loss / gradient norm per cell)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    start = time.time()
    cells = measure(args.steps, args.dtype)
    table = markdown(cells)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "steps": args.steps, "dtype": args.dtype, "commit": _commit(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "seconds": time.time() - start,
            "cells": cells}, indent=1))
        Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
