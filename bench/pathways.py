"""Pathways' dispatch benchmark: a chain of small SPMD functions through the controller.

For each compute length, a chain of ``--chain`` functions (a compute, then an
all-reduce over the mesh; ``bench/_pathways_steps.py``) runs on one island of
``--ranks`` workers three ways, in one job:

* ``spmd``: the same chain as a multi-controller program under torchrun (every rank
  runs it itself), before and after the controller's runs (their ratio is the A/A);
* ``parallel``: through the controller, every call dispatched at once (Pathways'
  parallel asynchronous dispatch);
* ``sequential``: through the controller, each call sent once its input is done.

Each is microseconds per function (the whole chain's time over its length, the median of
``--repeats`` chains); the table gives each controller mode's
throughput over SPMD's (1.0 = SPMD's), and the smallest compute at which parallel
dispatch is within 5% of SPMD. A second table is the dispatch path alone (a function
that does nothing, on one worker and on all): the built-in controller beside Ray's actor
calls and compiled graphs (``bench/ray_dispatch.py``), in the same job.

``--jobs K`` runs K fresh jobs and reports medians with their ranges::

    python -m bench.pathways --ranks 2 --chain 200 --jobs 3 --out records/pathways
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import _c2c, _provenance

ROOT = Path(__file__).resolve().parents[1]
COMPUTES_US = "0,100,300,1000,3000,10000"
WITHIN = 0.95  # "within 5% of SPMD"
# The controller's ways: the default (inputs checked on every rank before a function
# runs: one small all-reduce more per function), that check off, and sequential dispatch.
MODES = ("parallel", "parallel-unchecked", "sequential")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pathways", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--chain", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--computes-us", default=COMPUTES_US)
    p.add_argument("--kind", choices=["sleep", "spin"], default="sleep")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--no-ray", action="store_true", help="leave Ray's column out")
    p.add_argument("--out", default="records/pathways")
    p.add_argument("--one-job", default="", help=argparse.SUPPRESS)  # a job's JSON path
    p.add_argument("--summarize", action="store_true", help="only the tables of the jobs "
                   "already in --out (job*.json)")
    return p.parse_args(argv)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


def spmd(a: argparse.Namespace) -> dict[str, list[float]]:
    """µs per step of the torchrun SPMD chain, per compute length."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "spmd.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={a.ranks}", "-m", "bench._pathways_spmd",
               "--computes-us", a.computes_us, "--chain", str(a.chain),
               "--repeats", str(a.repeats), "--kind", a.kind, "--json", str(out)]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT, capture_output=True)
        return json.loads(out.read_text())


def controller(a: argparse.Namespace, cluster: Any) -> dict[str, dict[str, list[float]]]:
    """µs per step through the controller, per dispatch mode and compute length."""
    from bench._pathways_steps import pw_step
    from pycomm.parallel import pathways as pw

    spec = pw.spec((8,), torch.float64)
    results: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for us in (float(c) for c in a.computes_us.split(",")):
        for mode in results:
            with cluster.client(dispatch=mode.split("-")[0], check_inputs=not mode.endswith(
                    "unchecked")) as client:
                mesh = client.mesh(0, (a.ranks,))
                runs = []
                for _ in range(a.repeats + 1):  # the first warms up
                    t0 = time.perf_counter()
                    y = client.call(pw_step, mesh, torch.ones(8, dtype=torch.float64),
                                    us * 1e-6, a.kind, out=spec)
                    for _ in range(a.chain - 1):
                        y = client.call(pw_step, mesh, y, us * 1e-6, a.kind, out=spec)
                    y.wait()
                    runs.append((time.perf_counter() - t0) / a.chain * 1e6)
                results[mode][f"{us:g}"] = runs[1:]
                mesh.release()
    return results


def dispatch_only(a: argparse.Namespace, cluster: Any) -> dict[str, float]:
    """µs per call of a function that does nothing: on one worker and on every one."""
    from bench._pathways_steps import pw_noop

    out = {}
    n = 1000
    for mode in ("parallel", "sequential"):
        with cluster.client(dispatch=mode) as client:
            for size in sorted({1, a.ranks}):
                mesh = client.mesh(0, (size,))
                runs = []
                for _ in range(a.repeats + 1):
                    t0 = time.perf_counter()
                    y = client.call(pw_noop, mesh, 0)
                    for _ in range(n - 1):
                        y = client.call(pw_noop, mesh, y)
                    y.wait()
                    runs.append((time.perf_counter() - t0) / n * 1e6)
                out[f"builtin-{mode}-{size}"] = statistics.median(runs[1:])
                mesh.release()
    return out


def ray_peer(a: argparse.Namespace) -> dict[str, float]:
    from bench.ray_dispatch import ray_dispatch

    out = {}
    for actors in sorted({1, a.ranks}):
        r = ray_dispatch(1000, actors, a.repeats)
        for kind in ("sequential", "pipelined", "compiled"):
            if kind in r["us_per_call"]:
                out[f"ray-{kind}-{actors}"] = r["us_per_call"][kind]
    return out


def one_job(a: argparse.Namespace) -> dict:
    from pycomm.parallel import pathways as pw

    before = _c2c.reading()
    load = os.getloadavg()
    job: dict = {"spmd_a": spmd(a)}
    with pw.Cluster([a.ranks], timeout_s=120, env={"PYTHONPATH": str(ROOT),
                                                  "OMP_NUM_THREADS": "1"}) as cluster:
        job["controller"] = controller(a, cluster)
        job["dispatch"] = dispatch_only(a, cluster)
    job["spmd_b"] = spmd(a)
    if not a.no_ray:
        job["dispatch"].update(ray_peer(a))
    job["c2c"] = [_c2c.describe(before), _c2c.describe(_c2c.reading())]
    job["load"] = list(load)
    job["provenance"] = _provenance.collect([], sys.argv)
    job["settings"] = vars(a)
    return job


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(jobs: list[dict]) -> tuple[list[str], list[dict]]:
    """The table's lines (medians over jobs, with ranges) and its rows."""
    rows = []
    for us in jobs[0]["spmd_a"]:
        per_job = []
        for j in jobs:
            s = _med(j["spmd_a"][us])
            per_job.append({"spmd": s, "aa": s / _med(j["spmd_b"][us]),
                            **{m: s / _med(j["controller"][m][us]) for m in MODES}})
        row: dict[str, Any] = {"compute_us": float(us)}
        for key in ("spmd", "aa", *MODES):
            vals = [p[key] for p in per_job]
            row[key] = (_med(vals), min(vals), max(vals))
        rows.append(row)
    lines = ["throughput over SPMD's (1.0 = SPMD), median over jobs [range]",
             f"{'compute':>9} {'spmd us/step':>16} {'A/A':>19}"
             + "".join(f" {m:>19}" for m in MODES)]
    for r in rows:
        lines.append(f"{r['compute_us']:>7g}us {_cell(r['spmd'], '.0f'):>16} "
                     f"{_cell(r['aa']):>19}" + "".join(f" {_cell(r[m]):>19}" for m in MODES))
    for mode in MODES:
        smallest = min((r["compute_us"] for r in rows if all(
            q[mode][0] >= WITHIN for q in rows if q["compute_us"] >= r["compute_us"])),
            default=None)
        lines.append(f"smallest compute from which {mode} is within 5% of SPMD: "
                     f"{'none measured' if smallest is None else f'{smallest:g} us'}")
    return lines, rows


def summary_of(out: Path, jobs: list[dict]) -> list[str]:
    """The tables of ``jobs``, also written to ``out/summary.json``."""
    lines, rows = summarize(jobs)
    lines += dispatch_lines(jobs)
    lines += [f"c2c per job: {[j['c2c'] for j in jobs]}",
              f"load per job (1/5/15 min): {[j['load'] for j in jobs]}"]
    (out / "summary.json").write_text(json.dumps({"rows": rows, "lines": lines}, indent=1))
    return lines


def _cell(v: tuple[float, float, float], fmt: str = ".3f") -> str:
    return f"{v[0]:{fmt}} [{v[1]:{fmt}}-{v[2]:{fmt}}]"


def dispatch_lines(jobs: list[dict]) -> list[str]:
    keys = sorted(jobs[0]["dispatch"])
    lines = ["dispatch path alone, us per call (median over jobs [range])"]
    for k in keys:
        vals = [j["dispatch"][k] for j in jobs if k in j["dispatch"]]
        lines.append(f"  {k:<24} {_cell((_med(vals), min(vals), max(vals)), '.0f')}")
    return lines


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if a.one_job:
        Path(a.one_job).write_text(json.dumps(one_job(a), indent=1))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.summarize:
        jobs = [json.loads(p.read_text()) for p in sorted(out.glob("job*.json"))]
        print("\n".join(summary_of(out, jobs)))
        return
    jobs = []
    for k in range(a.jobs):
        path = out / f"job{k + 1}.json"
        cmd = [sys.executable, "-m", "bench.pathways", *(argv or sys.argv[1:]),
               "--one-job", str(path)]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
        jobs.append(json.loads(path.read_text()))
    print("\n".join(summary_of(out, jobs)))


if __name__ == "__main__":
    main()
