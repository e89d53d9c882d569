"""The offload bit-identity table: every case of tests/test_offload.py and
tests/test_zero_offload.py (the same runs, 2 ranks) as one Markdown table of the largest
absolute difference of any parameter, on any rank, between the offloaded run and the
same recipe in memory (0: ``torch.equal``), with the refused combinations and why.

    python -m tests.offload_table --out records/offload/identity.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the scenarios' imports

STAGE3 = [  # (row, model, reference key, offloaded key, steps)
    ("fp32, to files", "gpt", ("gpt", "none"), ("gpt", "disk"), 10),
    ("fp32, to host memory", "gpt", ("gpt", "none"), ("gpt", "cpu"), 10),
    ("fp32, to files", "llama", ("llama", "none"), ("llama", "disk"), 10),
    ("fp32, to host memory", "llama", ("llama", "none"), ("llama", "cpu"), 10),
    ("clipping 0.3 (every step clipped)", "gpt", ("gpt", "clip none"), ("gpt", "clip disk"), 10),
    ("clipping 0.3 (every step clipped)", "llama", ("llama", "clip none"),
     ("llama", "clip disk"), 10),
    ("2 micro-batches + clipping", "gpt", ("gpt", "accumulate none"),
     ("gpt", "accumulate disk"), 10),
    ("bf16 (fp32 masters)", "gpt", ("gpt", "bf16 none"), ("gpt", "bf16 disk"), 10),
    ("bf16 (fp32 masters)", "llama", ("llama", "bf16 none"), ("llama", "bf16 disk"), 10),
    ("fp16 + loss scaling (first steps overflow) + clipping", "gpt", ("gpt", "fp16 none"),
     ("gpt", "fp16 disk"), 10),
    ("bf16 under a live budget, embedding and head units", "llama", ("llama", "bf16 none"),
     "budget", 10),
    ("tiles: embedding and head as 4 units each, bf16, clipping 0.3", "llama",
     ("llama", "tiles none"), ("llama", "tiles disk"), 10),
    ("activation checkpointing", "gpt", ("recompute", "none"), ("recompute", "disk"), 4),
    ("SGD with momentum", "gpt", ("sgd-momentum", "none"), ("sgd-momentum", "disk"), 4),
    ("Adagrad", "gpt", ("adagrad", "none"), ("adagrad", "disk"), 4),
    ("Adam with amsgrad", "gpt", ("adam-amsgrad", "none"), ("adam-amsgrad", "disk"), 4),
]
REFUSED = [  # (what, the refusal's words, what runs instead)
    ("offload at zero=0", "zero=0 (offload moves ZeRO's optimizer state: zero 1-2, or "
     "ZeRO-3's units: zero=3)", "any stage 1-3, above"),
    ("offload with expert parallelism", "ep=2 (the experts beside ZeRO-3 stay whole in "
     "memory, stepped after backward; offload steps units in backward)",
     "offload at ep=1 (the experts are then dense parameters)"),
    ("an optimizer that needs a closure", "optimizer=LBFGS (...)",
     "any per-element torch.optim optimizer, above")]


def _largest(results: list[dict[Any, Any]], want: Any, got: Any) -> float:
    worst = 0.0
    for result in results:
        ref, off = result[want]["params"], result[got]["params"]
        for name, value in ref.items():
            worst = max(worst, float((off[name].double() - value.double()).abs().max()))
    return worst


def measure() -> dict[str, Any]:
    from _offload_scenarios import run_all as stage3_runs
    from _zero_offload_scenarios import CASES
    from _zero_offload_scenarios import STEPS as ZO_STEPS
    from _zero_offload_scenarios import run_all as zero_offload_runs

    from pycomm.testing import run_ranks

    with tempfile.TemporaryDirectory() as root:
        stage3 = run_ranks(stage3_runs, 2, os.path.join(root, "s3"), timeout_s=900.0)
        staged = run_ranks(zero_offload_runs, 2, os.path.join(root, "zo"), timeout_s=900.0)
    rows = []
    for label, model, want, got, steps in STAGE3:
        rows.append({"stage": "ZeRO-3 offload", "case": label, "model": model,
                     "steps": steps, "max_abs_diff": _largest(stage3, want, got)})
    for name in CASES:
        stage = "ZeRO-3 offload" if name.startswith("zero3") else "ZeRO-Offload"
        rows.append({"stage": stage, "case": name, "model": "gpt", "steps": ZO_STEPS,
                     "max_abs_diff": _largest(staged, (name, "none"), (name, "disk"))})
    return {"rows": rows, "refused": REFUSED, "torch": torch.__version__}


def markdown(result: dict[str, Any]) -> str:
    lines = ["Parameters after the steps, offloaded against the same recipe in memory, "
             "dp=2 unless named (largest |difference| over every parameter and rank; 0 is "
             "`torch.equal`)", "", "| offload | case | model | steps | max abs difference |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        diff = "0 (torch.equal)" if r["max_abs_diff"] == 0 else f"{r['max_abs_diff']:.3g}"
        lines.append(f"| {r['stage']} | {r['case']} | {r['model']} | {r['steps']} | {diff} |")
    lines += ["", "Refused before the first step, by name:", ""]
    lines += [f"- {what}: `{why}`; runs instead: {instead}"
              for what, why, instead in result["refused"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the JSON here and the table beside")
    args = parser.parse_args()
    result = measure()
    table = markdown(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
