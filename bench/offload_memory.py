"""What offload holds in memory, measured against what the planner predicts.

``python -m bench.offload_memory`` (about 5 minutes): the trainer's GPT (width 512, 8
blocks, vocabulary 8192; buckets of 4 MB, so ZeRO-1/2 have some 30 to hold one at a
time) at dp=2, each run a fresh ``python -m pycomm.parallel.train`` with its
process tree in one uncapped cgroup (bench._memcap), 3 steps, clipping 1.0:

- ``budget``: ZeRO-3 offloaded to disk without a live budget and at three
  ``--max-live-mb`` settings: the pool's peak (rank 0), the records held at most, the
  cgroup's peak and the largest rank's peak RSS, beside the planner's prediction of the
  pool and of the rank's peak (``pycomm.parallel.planner``, the same settings);
- ``zero-offload``: ZeRO-1 and ZeRO-2 in memory and with ``--offload disk`` (the
  optimizer state in the store): the same measures, and the planner's optimizer bytes.

Raw results go to ``records/offload/memory.json``, tables to ``memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._memcap import available, run_capped
from bench._provenance import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "records", "offload")
MIB = 2**20
MODEL = ["--model", "gpt", "--n-layer", "8", "--n-embd", "512", "--n-head", "8",
         "--block-size", "64", "--batch-size", "4", "--dp", "2", "--steps", "3",
         "--max-grad-norm", "1.0", "--bucket-mb", "4", "--threads", "1", "--log-every", "1",
         "--no-progress"]
BUDGETS = [0, 64, 24, 8]  # MiB; a block's gathered fp32 unit is 12 MiB, its gradient too
NO_CAP = 64 << 30


def _flags(zero: int, offload: bool, live_mb: int, work: str) -> list[str]:
    out = [*MODEL, "--zero", str(zero)]
    if offload:
        out += ["--offload", "disk", "--offload-dir", os.path.join(work, "off")]
    if live_mb:
        out += ["--max-live-mb", str(live_mb)]
    return out


def _measure(flags: list[str], work: str) -> dict[str, Any]:
    metrics = os.path.join(work, "m.jsonl")
    cmd = [sys.executable, "-m", "pycomm.parallel.train", *flags, "--metrics", metrics]
    run = run_capped(cmd, NO_CAP, 900.0, cwd=ROOT, whole_tree=True)
    if run.returncode != 0:
        raise SystemExit(f"bench.offload_memory: {' '.join(flags)} failed:\n"
                         f"{run.stderr[-2000:]}")
    with open(metrics) as f:
        steps = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    os.unlink(metrics)
    stage3 = steps[-1].get("stage3", {})
    return {"cgroup_peak": run.max_usage_bytes, "rank_peak_rss": steps[-1]["peak_rss_mb"] * MIB,
            "pool_peak": stage3.get("pool_peak_bytes"), "held_back": stage3.get("held_back"),
            "max_records": stage3.get("max_records"), "loss": [s["loss"] for s in steps]}


def _predict(flags: list[str]) -> dict[str, int]:
    """The planner's memory for exactly this layout and settings (its rank peak)."""
    from pycomm.parallel.job.config import parse
    from pycomm.parallel.planner.fit import layout_of, worst_rank
    from pycomm.parallel.planner.memory import job_of
    from pycomm.parallel.planner.shapes import model_shape

    cfg = parse(flags)
    mem = worst_rank(model_shape(cfg), layout_of(cfg), job_of(cfg))
    return {"peak": mem.peak, "pool": mem.buffers.get("zero3 pool", 0),
            "records": mem.buffers.get("offload records", 0), "optimizer": mem.optimizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    if reason := available():
        raise SystemExit(f"bench.offload_memory: {reason}")
    work = tempfile.mkdtemp(prefix="pycomm-offload-memory-")
    rows: dict[str, list[dict[str, Any]]] = {"budget": [], "zero-offload": []}
    try:
        for live in BUDGETS:
            flags = _flags(3, True, live, work)
            rows["budget"].append({"max_live_mb": live, **_measure(flags, work),
                                   "predicted": _predict(flags)})
            print(json.dumps(rows["budget"][-1]), flush=True)
        for zero in (1, 2):
            for offload in (False, True):
                flags = _flags(zero, offload, 0, work)
                rows["zero-offload"].append({"zero": zero, "offload": offload,
                                             **_measure(flags, work),
                                             "predicted": _predict(flags)})
                print(json.dumps(rows["zero-offload"][-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"model": MODEL, "rows": rows, "loadavg": os.getloadavg()}
    out = os.path.join(RESULTS, "memory.json")
    write_report(result, out)  # with the commit, versions and CPU
    table = _table(result)
    Path(out).with_suffix(".md").write_text(table)
    print(table)


def _mib(x: Any) -> str:
    return "-" if x is None else f"{x / MIB:.0f}"


def _table(result: dict[str, Any]) -> str:
    lines = ["GPT width 512, 8 blocks, vocabulary 8192, dp=2, batch 4x64, clipping 1.0, "
             "buckets of 4 MB, 3 steps; MiB; measured against the planner's prediction", "",
             "ZeRO-3 offloaded to disk, by live budget (`--max-live-mb`):", "",
             "| budget | pool peak (rank 0) | predicted pool | prefetches held back | "
             "records held at most | largest rank peak RSS | predicted rank peak | "
             "cgroup peak (both ranks and launcher) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]["budget"]:
        p = r["predicted"]
        lines.append(f"| {r['max_live_mb'] or 'none'} | {_mib(r['pool_peak'])} | "
                     f"{_mib(p['pool'])} | {r['held_back']} | {r['max_records']} | "
                     f"{_mib(r['rank_peak_rss'])} | {_mib(p['peak'])} | "
                     f"{_mib(r['cgroup_peak'])} |")
    lines += ["", "ZeRO-Offload (stages 1-2: the optimizer state in the store):", "",
              "| stage | optimizer state | predicted optimizer bytes in memory | "
              "predicted records | largest rank peak RSS | predicted rank peak | "
              "cgroup peak |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]["zero-offload"]:
        p = r["predicted"]
        lines.append(f"| ZeRO-{r['zero']} | {'disk' if r['offload'] else 'in memory'} | "
                     f"{_mib(p['optimizer'])} | {_mib(p['records'])} | "
                     f"{_mib(r['rank_peak_rss'])} | {_mib(p['peak'])} | "
                     f"{_mib(r['cgroup_peak'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
