"""ZeRO-3 offload to disk: does reading ahead hide the I/O, and does a model whose training
state is over 3x a memory cap train under it?

``python -m bench.offload overlap``: the same GPT at dp=2, ZeRO-3 in memory (its step
time is the compute time) and offloaded to files with prefetch depth 0, 1 and 2: step
time against the sum of the I/O threads' busy time and the compute time (no overlap
would take their sum; perfect overlap the larger of the two).

``python -m bench.offload large``: a GPT whose replicated fp32 Adam state (16 bytes per
parameter) is >= 3x a cgroup memory cap shared by both ranks, offloaded, 5 steps; then
the same model in memory under the same cap (killed by it). ``ram``: the same with a model
whose state is >= 3x this machine's RAM (MemTotal), under a cap just below the RAM (so the
in-memory run is killed by its own cgroup, not by the kernel's global OOM killer; the unit
files need about 12 bytes per parameter of free disk). ``cap-ci``: the same for
tests/test_offload_cap.py's case (one rank, a 320 MiB cap). Peak RSS, the cgroup's peak
usage, bytes read and written, step times.

Raw results go to ``records/offload/<name>.json`` and a table to ``<name>.md``
(run under ``nice -n 19 ionice -c3``; the cap needs root: see bench._memcap).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from bench._memcap import available, run_capped
from bench._offload_rank import CI_CAP, CI_CASE, param_count, state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "records", "offload")
# small batches: compute of the order of the I/O, so hiding the one behind the other shows
OVERLAP = dict(vocab=256, seq=32, n_layer=24, n_head=8, n_embd=512, batch=2, steps=8,
               ranks=2)
LARGE_CAP = 2 << 30
LARGE = dict(vocab=256, seq=16, n_layer=57, n_head=12, n_embd=768, batch=2, steps=5,
             ranks=2, prefetch=2, timeout_s=540)
GIB = 2**30
# room left outside the cap for the shell, the launcher and the page cache's dirty pages
RAM_HEADROOM = 3 * GIB // 2
RAM_SHAPE = dict(vocab=256, seq=16, n_head=16, n_embd=2048, batch=2, steps=5, ranks=2,
                 prefetch=2)
DISK_BYTES_PER_PARAM = 12  # a rank's fp32 shard, exp_avg, exp_avg_sq in unit files


def machine_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("bench.offload ram: no MemTotal in /proc/meminfo")


def ram_case(ram: int) -> dict[str, Any]:
    """The shallowest RAM_SHAPE GPT whose replicated state is >= 3x ``ram``: layers are
    added until it is (each ~50M parameters at n_embd 2048)."""
    case = {**RAM_SHAPE, "n_layer": 1}
    per_layer = param_count({**case, "n_layer": 2}) - param_count(case)
    base = param_count(case) - per_layer
    case["n_layer"] = -(-(3 * ram // 16 - base) // per_layer)
    assert state_bytes(case) >= 3 * ram
    return case


def _check_disk(directory: str, case: dict[str, Any]) -> None:
    need = DISK_BYTES_PER_PARAM * param_count(case)
    free = shutil.disk_usage(directory).free
    if free < need * 1.05:
        raise SystemExit(f"bench.offload: the unit files need {need / GIB:.1f} GiB, "
                         f"{directory} has {free / GIB:.1f} GiB free")


def _cmd(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "bench._offload_rank", json.dumps(spec)]


def _parse(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def _steady(ranks: list[dict[str, Any]], key: str) -> float:
    """Mean over the steps after the first (which records the order: nothing is read
    ahead in its forward) of the slowest rank's ``key``."""
    steps = len(ranks[0]["steps"])
    return statistics.mean(max(r["steps"][s][key] for r in ranks) for s in range(1, steps))


def overlap(directory: str) -> dict[str, Any]:
    runs = {}
    for name, extra in [("in memory", {"offload": "none"}),
                        *[(f"depth {k}", {"offload": "disk", "prefetch": k, "dir": directory})
                          for k in (0, 1, 2)]]:
        spec = {**OVERLAP, **extra}
        done = subprocess.run(_cmd(spec), capture_output=True, text=True, cwd=ROOT,
                              check=True, timeout=600)
        runs[name] = _parse(done.stdout)["ranks"]
    return {"spec": OVERLAP, "params": param_count(OVERLAP), "runs": runs}


def overlap_table(raw: dict[str, Any]) -> str:
    compute = _steady(raw["runs"]["in memory"], "step_s")
    writes = "write_wait_s" in raw["runs"]["depth 0"][0]["steps"][0]  # from run 3 on
    rows = ["| run | step s | I/O busy s | compute s | I/O + compute s | read wait s | "
            + ("write wait s | " if writes else "")
            + "unit steps s | GB read/step | GB written/step |",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if writes else "")]
    for name, ranks in raw["runs"].items():
        step = _steady(ranks, "step_s")
        if name == "in memory":
            rows.append(f"| {name} | {step:.2f} | - | {compute:.2f} | - | - | - | - | - |"
                        + (" - |" if writes else ""))
            continue
        io, wait = _steady(ranks, "io_s"), _steady(ranks, "read_wait_s")
        unit = _steady(ranks, "unit_step_s")
        write = f" {_steady(ranks, 'write_wait_s'):.2f} |" if writes else ""
        read = _steady(ranks, "bytes_read") * len(ranks) / 1e9
        wrote = _steady(ranks, "bytes_written") * len(ranks) / 1e9
        rows.append(f"| {name} | {step:.2f} | {io:.2f} | {compute:.2f} | {io + compute:.2f} | "
                    f"{wait:.2f} |{write} {unit:.2f} | {read:.2f} | {wrote:.2f} |")
    head = (f"GPT {raw['params'] / 1e6:.1f}M parameters, dp=2 ZeRO-3, batch "
            f"{raw['spec']['batch']}x{raw['spec']['seq']}; steps 2-{raw['spec']['steps']}, "
            "slowest rank (I/O busy: one rank's I/O threads)")
    return head + "\n\n" + "\n".join(rows) + "\n"


def capped(directory: str, case: dict[str, Any], cap: int,
           timeout_s: float = 600) -> dict[str, Any]:
    """``case`` offloaded to disk, then in memory, each under a ``cap``-byte cgroup."""
    out: dict[str, Any] = {"spec": case, "cap_bytes": cap, "params": param_count(case),
                           "state_bytes": state_bytes(case)}
    _check_disk(directory, case)
    for name in ("disk", "none"):
        spec = {**case, "offload": name, "dir": directory, "timeout_s": timeout_s}
        run = run_capped(_cmd(spec), cap, timeout_s=timeout_s + 60, cwd=ROOT)
        entry: dict[str, Any] = {"cgroup": run.summary(), "stderr_tail": run.stderr[-1500:]}
        if run.returncode == 0:
            entry["ranks"] = _parse(run.stdout)["ranks"]
        out[name] = entry
    return out


def capped_table(raw: dict[str, Any]) -> str:
    ranks = raw["spec"]["ranks"]
    ram = (f", {raw['state_bytes'] / raw['ram_bytes']:.2f}x the machine's "
           f"{raw['ram_bytes'] / GIB:.2f} GiB RAM" if "ram_bytes" in raw else "")
    lines = [f"GPT {raw['params'] / 1e6:.0f}M parameters: replicated fp32 Adam state "
             f"{raw['state_bytes'] / GIB:.2f} GiB = {raw['state_bytes'] / raw['cap_bytes']:.2f}x "
             f"the {raw['cap_bytes'] / GIB:.2f} GiB cap{ram} (cgroup memory.limit_in_bytes, "
             f"{'both ranks' if ranks > 1 else 'one rank'}), dp={ranks} ZeRO-3", "",
             "| run | exit | OOM kills | cgroup peak GiB | peak RSS per rank GiB | step s "
             "(steps 1-5) | GB read | GB written |", "|---|---|---|---|---|---|---|---|"]
    for name in ("disk", "none"):
        entry, cg = raw[name], raw[name]["cgroup"]
        ranks = entry.get("ranks")
        label = "offload disk" if name == "disk" else "in memory"
        if ranks:
            rss = " / ".join(f"{r['peak_rss_mb'] / 1024:.2f}" for r in ranks)
            steps = ", ".join(f"{max(r['steps'][s]['step_s'] for r in ranks):.1f}"
                              for s in range(len(ranks[0]["steps"])))
            read = sum(r["offload"]["bytes_read"] for r in ranks) / 1e9
            wrote = sum(r["offload"]["bytes_written"] for r in ranks) / 1e9
            rest = f"{rss} | {steps} | {read:.1f} | {wrote:.1f}"
        else:
            rest = "- | killed | - | -"
        lines.append(f"| {label} | {cg['returncode']} | {cg['oom_kills']} | "
                     f"{cg['max_usage_bytes'] / GIB:.2f} | {rest} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__)
    parser.add_argument("what", choices=("overlap", "large", "ram", "cap-ci"))
    parser.add_argument("--dir", default="", help="where the unit files go (default: a "
                        "temporary folder under the repository's disk)")
    parser.add_argument("--name", default="", help="results file stem (default: WHAT; "
                        "another name keeps a repeated run beside the first)")
    parser.add_argument("--report", action="store_true", help="only remake the table from "
                        "the committed raw results")
    args = parser.parse_args(argv)
    stem = args.name or args.what
    raw_path = os.path.join(RESULTS, f"{stem}.json")
    if not args.report:
        if args.what != "overlap" and available():
            raise SystemExit(f"bench.offload {args.what}: {available()}")
        with tempfile.TemporaryDirectory(dir=args.dir or ROOT) as directory:
            if args.what == "overlap":
                raw = overlap(directory)
            elif args.what == "ram":
                ram = machine_ram()
                raw = {**capped(directory, ram_case(ram), ram - RAM_HEADROOM, 5400),
                       "ram_bytes": ram}
            else:
                case, cap = (LARGE, LARGE_CAP) if args.what == "large" else (CI_CASE, CI_CAP)
                raw = capped(directory, case, cap)
        os.makedirs(RESULTS, exist_ok=True)
        with open(raw_path, "w") as f:
            json.dump(raw, f, indent=1)
    with open(raw_path) as f:
        raw = json.load(f)
    table = overlap_table(raw) if args.what == "overlap" else capped_table(raw)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
