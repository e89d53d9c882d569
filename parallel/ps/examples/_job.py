"""What the examples share: their command line, launching themselves as a job, and one
JSON line per step.

Run as ``python -m pycomm.parallel.ps.examples.logreg --servers 2 --workers 4 ...``, an example
starts ``pycomm.parallel.ps.launch`` with itself as the worker command; each worker (``PS_ROLE``
set by the launcher) then runs the training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def job_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    job = p.add_argument_group("the job")
    job.add_argument("--servers", type=int, default=2)
    job.add_argument("--workers", type=int, default=2)
    job.add_argument("--replicas", type=int, default=0)
    job.add_argument("--consistency", choices=["bsp", "ssp", "async"], default="bsp")
    job.add_argument("--tau", type=int, default=2, help="ssp: the largest lead in steps")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=50)
    train.add_argument("--batch-size", type=int, default=64, help="examples per worker")
    train.add_argument("--lr", type=float, default=0.3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--metrics", default="", help="FILE.jsonl: one line per worker step")
    train.add_argument("--slow-worker", type=int, default=-1, help="this worker sleeps "
                       "--slow-ms after each step (the straggler SSP is for)")
    train.add_argument("--slow-ms", type=float, default=0.0)
    train.add_argument("--codec", choices=["none", "fp16", "bf16", "int8"], default="none",
                       help="compress pushed values on the wire")
    train.add_argument("--filter-threshold", type=float, default=0.0, help="push only rows "
                       "whose largest |gradient| reaches this (the rest is kept and added "
                       "to a later push)")
    train.add_argument("--check", action="store_true", help="worker 0 also trains one "
                       "process on the concatenated batches and reports the difference")
    return p


def launch_unless_worker(args: argparse.Namespace, module: str) -> int | None:
    """Outside a job: run one (this module as every worker) and return its exit status.
    Inside (a worker): None."""
    if os.environ.get("PS_ROLE") == "worker":
        return None
    from ..launch import main as launch

    if args.metrics and os.path.exists(args.metrics):
        os.remove(args.metrics)
    return launch(["--servers", str(args.servers), "--workers", str(args.workers),
                   "--replicas", str(args.replicas), "--consistency", args.consistency,
                   "--tau", str(args.tau), "--", sys.executable, "-m", module, *sys.argv[1:]])


def run_example(parser: argparse.ArgumentParser, module: str,
                train: Callable[[argparse.Namespace], None], argv: list[str] | None) -> int:
    """An example's ``main``: launch the job, or (as one of its workers) train."""
    args = parser.parse_args(argv)
    status = launch_unless_worker(args, module)
    if status is not None:
        return status
    train(args)
    return 0


class Metrics:
    """Appends one JSON line per call (every worker to the same file: each line is one
    small write, which O_APPEND keeps whole)."""

    def __init__(self, path: str):
        self.path, self.start = path, time.perf_counter()
        if path:  # runs/x.jsonl on a fresh checkout: its folder is made
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({**fields, "t": round(time.perf_counter() - self.start, 4)}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
