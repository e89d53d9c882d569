"""The mixture-of-experts table: the GPT with experts, Mixtral and Qwen3-MoE x real-batch
case x every layout of ``_moe_scenarios`` (expert parallelism, experts by tp, pipelines
under GPipe) trained ``--steps`` steps against HuggingFace's own objective in one process;
prints the largest relative difference of the loss (cross-entropy + coefficient x aux
loss) and of the pre-clip gradient norm per cell, as Markdown, and writes them as JSON.
With ``--precision bf16`` (compute in bf16, fp32 masters) the reference is one process
of the same recipe: the engine on one rank.

    python -m tests.moe_table --steps 20 --out records/moe/fp32.json
    python -m tests.moe_table --steps 20 --precision bf16 --out records/moe/bf16.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from pycomm.testing import RankPool
from tests import _moe_scenarios as sc
from tests import _real_batch_scenarios as rb
from tests.real_batch_table import _commit, markdown


def reference(steps: int, precision: str | None) -> dict[tuple[str, str], list[Any]]:
    """One process: HuggingFace's objective in plain torch (fp32), or the engine on one
    rank in ``precision``."""
    if precision is None:
        return {(m, c): sc.one_process(m, c, steps) for m in sc.MODELS for c in sc.CASES}
    with RankPool(1, backend="pycomm", pg_timeout_s=300) as pool:
        return pool.run(sc.curves, sc.ONE, steps, None, precision)[0]


def measure(steps: int, precision: str | None = None) -> dict[str, dict[str, list[float]]]:
    want = reference(steps, precision)
    cells: dict[str, dict[str, list[float]]] = {}
    for world in sorted({sc.world_of(name) for name in sc.layouts()}):
        with RankPool(world, backend="pycomm", pg_timeout_s=300) as pool:
            for layout in (n for n in sc.layouts() if sc.world_of(n) == world):
                ranks = pool.run(sc.curves, layout, steps, None, precision)
                cells[layout] = {
                    f"{m}/{c}": [max(rb.worst_relative(r[(m, c)], want[(m, c)])[i]
                                     for r in ranks) for i in (0, 1)]
                    for m, c in want}
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", choices=("bf16",), default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    start = time.time()
    cells = measure(args.steps, args.precision)
    table = markdown(cells)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "steps": args.steps, "precision": args.precision or "fp32", "commit": _commit(),
            "torch": torch.__version__,
            "seconds": time.time() - start, "cells": cells}, indent=1))
        Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
