"""The mixture-of-experts table: the GPT with experts, Mixtral and Qwen3-MoE x real-batch
case x every layout of ``_moe_scenarios`` (expert parallelism, experts by tp, pipelines
under GPipe) trained ``--steps`` steps against HuggingFace's own objective in one process;
prints the largest relative difference of the loss (cross-entropy + coefficient x aux
loss) and of the pre-clip gradient norm per cell, as Markdown, and writes them as JSON.

    python -m tests.moe_table --steps 20 --out bench/results/moe/fp32.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pycomm.testing import RankPool
from tests import _moe_scenarios as sc
from tests import _real_batch_scenarios as rb
from tests.real_batch_table import _commit, markdown


def measure(steps: int) -> dict[str, dict[str, list[float]]]:
    want = {(m, c): sc.one_process(m, c, steps) for m in sc.MODELS for c in sc.CASES}
    cells: dict[str, dict[str, list[float]]] = {}
    for world in sorted({sc.world_of(name) for name in sc.layouts()}):
        with RankPool(world, backend="pycomm", pg_timeout_s=300) as pool:
            for layout in (n for n in sc.layouts() if sc.world_of(n) == world):
                ranks = pool.run(sc.curves, layout, steps)
                cells[layout] = {
                    f"{m}/{c}": [max(rb.worst_relative(r[(m, c)], want[(m, c)])[i]
                                     for r in ranks) for i in (0, 1)]
                    for m, c in want}
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    start = time.time()
    cells = measure(args.steps)
    table = markdown(cells)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "steps": args.steps, "commit": _commit(), "torch": torch.__version__,
            "seconds": time.time() - start, "cells": cells}, indent=1))
        Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
