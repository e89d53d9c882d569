"""Adam on the host: which implementation should an offloaded unit's step use?

``python -m bench.host_adam`` (``--jobs 3`` fresh processes, each timing every
implementation on the same tensors): one AdamW step over ``--numel`` fp32 elements (a
TinyLlama block's shard at dp=2 by default: 22.1M), as ``torch.optim.AdamW`` with its
per-tensor loop (``foreach=False``), ``foreach=True`` and ``fused=True``; the offloaded
unit's step (:func:`pycomm.parallel.zero.offload_step.unit_stepper`, the inner optimizer run
on pieces pointed into a record) with the default and the fused optimizer; and
DeepSpeed's ``DeepSpeedCPUAdam`` where it builds. ``fused (A/A)`` times the fused step
a second time in the same job: the spread between equal things. Each cell is the
median over jobs of each job's median of ``--steps`` steps, with the range over jobs;
the ratio is to the per-tensor loop. Raw results and the machine's load go to
``records/offload/host-adam.json`` and the table to ``host-adam.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench import _c2c
from bench._provenance import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "records", "offload")
NUMEL = 22_151_168  # a TinyLlama block (44.3M parameters) at dp=2
OPTIONS = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
LOOP = "AdamW (per-tensor loop)"


def _tensors(numel: int, pieces: int = 9) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A unit's shard cut into ``pieces`` parameters (as a block's), and a gradient."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(numel, generator=gen)
    bounds = [numel * k // pieces for k in range(pieces + 1)]
    params = [values[a:b].clone() for a, b in itertools.pairwise(bounds)]
    return params, torch.randn(numel, generator=gen) * 1e-3


def _torch_step(params: list[torch.Tensor], grad: torch.Tensor,
                **flags: Any) -> Callable[[], None]:
    members = [torch.nn.Parameter(p.clone()) for p in params]
    at = 0
    for q in members:
        q.grad = grad[at : at + q.numel()].clone()
        at += q.numel()
    opt = torch.optim.AdamW(members, **OPTIONS, **flags)
    return opt.step


def _unit_step(params: list[torch.Tensor], grad: torch.Tensor,
               **flags: Any) -> Callable[[], None]:
    from pycomm.parallel.zero.offload import ADAM_STATE
    from pycomm.parallel.zero.offload_step import unit_stepper
    from pycomm.parallel.zero.param_groups import Piece
    from pycomm.parallel.zero.unit_store import Record, RecordLayout

    numel = sum(p.numel() for p in params)
    pieces, at = [], 0
    for k, p in enumerate(params):
        pieces.append(Piece(0, at, at + p.numel(), k))
        at += p.numel()
    empties = [torch.nn.Parameter(torch.empty(0)) for _ in params]
    inner = torch.optim.AdamW([{"params": [q]} for q in empties], **OPTIONS, **flags)
    step = unit_stepper(inner, pieces, empties, lambda: None, ADAM_STATE)
    record = Record(RecordLayout(numel, torch.float32, ("master", *ADAM_STATE)),
                    torch.device("cpu"))
    record.data.zero_()
    record.field("master").copy_(torch.cat(params))
    unit = SimpleNamespace(index=0)
    return lambda: step(unit, grad, record)  # type: ignore[arg-type]


def _deepspeed_step(params: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    from pycomm.parallel._optional import require

    cpu_adam = require("deepspeed.ops.adam", "bench.host_adam's DeepSpeed peer").DeepSpeedCPUAdam

    members = [torch.nn.Parameter(p.clone()) for p in params]
    at = 0
    for q in members:
        q.grad = grad[at : at + q.numel()].clone()
        at += q.numel()
    opt = cpu_adam(members, adamw_mode=True, **OPTIONS)
    return opt.step


def _implementations() -> dict[str, Callable[..., Callable[[], None]]]:
    return {
        LOOP: lambda p, g: _torch_step(p, g, foreach=False),
        "AdamW foreach": lambda p, g: _torch_step(p, g, foreach=True),
        "AdamW fused": lambda p, g: _torch_step(p, g, fused=True),
        "fused (A/A)": lambda p, g: _torch_step(p, g, fused=True),
        "unit step (default AdamW)": lambda p, g: _unit_step(p, g),
        "unit step (fused AdamW)": lambda p, g: _unit_step(p, g, fused=True),
        "DeepSpeedCPUAdam": _deepspeed_step,
    }


def one_job(numel: int, steps: int) -> dict[str, Any]:
    """Every implementation's median step seconds in this process (or why it did not
    run)."""
    params, grad = _tensors(numel)
    out: dict[str, Any] = {}
    for name, make in _implementations().items():
        try:
            step = make(params, grad)
        except Exception as exc:  # a peer that does not build here: named, not timed
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        step()  # warm: state allocated, kernels chosen
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
        del step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=NUMEL)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one_job(args.numel, args.steps)))
        return
    load, before = os.getloadavg(), _c2c.reading()
    jobs = []
    for k in range(args.jobs):
        cmd = [sys.executable, "-m", "bench.host_adam", "--one", "--numel", str(args.numel),
               "--steps", str(args.steps), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
        jobs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"job {k + 1}: {jobs[-1]}", flush=True)
    result = {"numel": args.numel, "threads": args.threads, "steps": args.steps,
              "options": {k: list(v) if isinstance(v, tuple) else v
                          for k, v in OPTIONS.items()},
              "loadavg_before": load, "loadavg_after": os.getloadavg(),
              "c2c_before": before, "c2c_after": _c2c.reading(),
              "torch": torch.__version__, "cpu_capability":
              torch.backends.cpu.get_cpu_capability(), "jobs": jobs}
    out = os.path.join(RESULTS, "host-adam.json")
    write_report(result, out)  # with the commit, versions and CPU
    table = _table(result)
    Path(out).with_suffix(".md").write_text(table)
    print(table)


def _table(result: dict[str, Any]) -> str:
    jobs = result["jobs"]
    lines = [f"One AdamW step over {result['numel'] / 1e6:.1f}M fp32 elements (9 tensors), "
             f"{result['threads']} thread, torch {result['torch']} "
             f"({result['cpu_capability']}); {len(jobs)} fresh jobs, median of "
             f"{result['steps']} steps each; load average before/after "
             f"{result['loadavg_before'][0]:.2f}/{result['loadavg_after'][0]:.2f}; "
             f"before: {_c2c.describe(result['c2c_before'])}; after: "
             f"{_c2c.describe(result['c2c_after'])}", "",
             "| implementation | step ms (median, range over jobs) | GB/s of state | "
             "speed vs per-tensor loop |", "|---|---|---|---|"]
    # bytes an Adam step touches: param, grad, two moments read; param, moments written
    moved = 7 * 4 * result["numel"]
    for name in jobs[0]:
        values = [job[name] for job in jobs]
        if not all(isinstance(v, float) for v in values):
            lines.append(f"| {name} | not run: {values[0]} | - | - |")
            continue
        loop = statistics.median(job[LOOP] for job in jobs)
        mid = statistics.median(values)
        lines.append(f"| {name} | {mid * 1e3:.1f} ({min(values) * 1e3:.1f}-"
                     f"{max(values) * 1e3:.1f}) | {moved / mid / 1e9:.2f} | "
                     f"{loop / mid:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
