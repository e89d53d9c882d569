"""Per-block ``torch.compile`` against eager in one job: the trainer's step time (median of
the steps after the compiling ones, with the range) and the largest loss difference per
step, for the GPT and a Llama in a layout of its own.

    python -m bench.compile_step --out records/compile/step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import _provenance

RUNS = {"gpt dp2": ["--model", "gpt", "--dp", "2"],
        "llama tp2": ["--model", "llama", "--tp", "2"]}
COMMON = ["--n-layer", "4", "--n-embd", "128", "--block-size", "128", "--batch-size", "8",
          "--eval-every", "0", "--no-progress", "--log-every", "0"]


def run(args: list[str], steps: int, compiled: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "pycomm.parallel.train", *COMMON, *args, "--steps", str(steps),
               "--metrics", str(metrics), "--compile" if compiled else "--no-compile"]
        subprocess.run(cmd, check=True, capture_output=True)
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def measure(steps: int, warm: int) -> dict[str, dict]:
    out = {}
    for name, args in RUNS.items():
        eager, compiled = run(args, steps, False), run(args, steps, True)
        times = {k: [x["step_s"] for x in rows[warm:]]
                 for k, rows in (("eager", eager), ("compile", compiled))}
        out[name] = {
            **{f"{k}_step_s": {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for k, v in times.items()},
            "compile_first_steps_s": sum(x["step_s"] for x in compiled[:warm]),
            "ratio": statistics.median(times["compile"]) / statistics.median(times["eager"]),
            "max_loss_rel": max(abs(c["loss"] / e["loss"] - 1)
                                for c, e in zip(compiled, eager, strict=True))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm", type=int, default=5, help="steps left out (compiling)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = measure(args.steps, args.warm)
    for name, r in results.items():
        e, c = r["eager_step_s"], r["compile_step_s"]
        print(f"{name}: eager {e['median'] * 1e3:.1f} ms ({e['min'] * 1e3:.1f}-"
              f"{e['max'] * 1e3:.1f}), compiled {c['median'] * 1e3:.1f} ms "
              f"({c['min'] * 1e3:.1f}-{c['max'] * 1e3:.1f}): {r['ratio']:.2f}x; first "
              f"{args.warm} compiled steps {r['compile_first_steps_s']:.1f} s; loss within "
              f"{r['max_loss_rel']:.1e}")
    _provenance.write_report({"results": results, "steps": args.steps, "warm": args.warm,
                              "loadavg": list(os.getloadavg())}, args.out or None)


if __name__ == "__main__":
    main()
