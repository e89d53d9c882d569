"""What a benchmark result needs to be read later: versions, host, rank placement,
the environment that steers the backends, timestamps, and the core-to-core state.

nccl-tests prints the versions and where every rank runs before its table; this module
gathers the same for CPU collectives, plus the cache state of the cores (bench._c2c),
which moves shared-memory results by several times on small hosts.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

# Variables that change what a backend does (or how many threads a rank runs); of
# Open MPI's, the settings a user gives (mpirun adds dozens of its own bookkeeping).
ENV_PREFIXES = ("PYCOMM_", "GLOO_", "DS_", "MASTER_", "OMP_", "LOCAL_SIZE", "OMPI_MCA_btl",
                "OMPI_MCA_coll", "OMPI_MCA_pml", "OMPI_MCA_mpi_", "OMPI_MCA_hwloc",
                "OMPI_MCA_rmaps")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Python, torch, pycomm and every peer library that is installed."""
    from pycomm._install import version  # this copy's (PyPI's "pycomm" is another project)

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "pycomm": version()}
    for dist_name in ("mpi4py", "deepspeed"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist_name] = importlib.metadata.version(dist_name)
    if "mpi4py" in out:
        out["mpi"] = _mpi_library()
    return out


def _mpi_library() -> str:
    """The MPI library's own version line, without initialising MPI."""
    try:
        done = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.splitlines()[0] if done.stdout else "unknown"


# What the benchmarks write into the checkout themselves (bench/run_tables.sh: each table's
# results, then the READMEs' tables and quotes, then the headline plot). A table made
# after another in the same checkout must not read as made from changed code.
BENCH_OUTPUTS = ("records", "bench/README.md", "README.md", "docs/headline.png")
# ...but records/investigations/ is code that runs (python -m records.investigations.NAME)
CODE_IN_OUTPUTS = ("records/investigations",)


def git_commit(root: Path | None = None) -> str:
    """The checkout's commit (with '+dirty' when files other than BENCH_OUTPUTS differ, or
    files of CODE_IN_OUTPUTS), or '' outside git."""
    root = root or Path(__file__).resolve().parent.parent
    ignore = [f":(exclude){p}" for p in BENCH_OUTPUTS]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = "".join(
            subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno", "--",
                            *paths], capture_output=True, text=True, timeout=10).stdout.strip()
            for paths in ([".", *ignore], CODE_IN_OUTPUTS))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head + ("+dirty" if head and dirty else "")


def placement(rank: int) -> dict:
    """Where this rank runs: host, pid, the CPUs it may use, its local rank."""
    local = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", str(rank)))
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "cpus": _ranges(sorted(os.sched_getaffinity(0))), "local_rank": int(local),
            "threads": torch.get_num_threads()}


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def environment() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def header_lines(info: dict) -> list[str]:
    """The '# ...' lines printed above the tables."""
    v = info["versions"]
    lines = ["# " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"# host {info['host']} ({info['cpu']}), {os.cpu_count()} CPUs; commit "
             f"{info['commit'] or 'n/a'}; started {info['started']}"]
    for p in info["placement"]:
        lines.append(f"#   rank {p['rank']:>2} on {p['host']} pid {p['pid']} cpus {p['cpus']} "
                     f"local rank {p['local_rank']} threads {p['threads']}")
    env = info["env"]
    lines.append("# env: " + (" ".join(f"{k}={val}" for k, val in env.items()) or "(none set)"))
    return lines


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def collect(placements: list[dict], argv: list[str]) -> dict:
    """Rank 0's provenance record (placements gathered from every rank)."""
    return {"versions": versions(), "host": socket.gethostname(), "cpu": cpu_model(),
            "commit": git_commit(), "argv": [sys.executable, "-m", "bench.collectives", *argv],
            "started": now(), "loadavg": list(os.getloadavg()), "env": environment(),
            "placement": placements}


def write_report(report: dict, out: str | None) -> None:
    """``report`` with where and when it was measured (commit, time, versions, CPU), as
    JSON at ``out`` (nothing without one)."""
    import json

    report.update(commit=git_commit(), when=now(), versions=versions(), cpu=cpu_model())
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
