"""Rank side of ``bench.plan_accuracy``: every layout of one model built by the trainer's
own code (``pycomm.parallel.train.loop.build``) on one pool of ranks, and measured.

Per layout, on every rank: the bytes in use (malloc plus pycomm's shared-memory arena,
bench._memory_probe) just before the engine is built are the baseline; a first step
creates Adam's state; the second step runs under :class:`PeakSampler` (the most bytes in
use after any aten op, above the baseline: the rank's peak of the step, everything the
layout holds included) and :class:`ProcessMeter` (the rise of peak RSS); what the engine
holds after it is counted by role (:func:`held_bytes`); further steps are timed
(wall clock between barriers, the median)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from bench._memory_probe import PeakSampler, ProcessMeter, held_bytes, in_use, proc_status
from pycomm.parallel.recompute.saved_inputs import CheckpointArena

# the module (``pycomm.parallel.recompute.checkpoint`` the attribute is the function)
checkpoint_module = importlib.import_module("pycomm.parallel.recompute.checkpoint")


def _batch(cfg: Any, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed + step)
    return torch.randint(0, 256, (cfg.batch_size, cfg.block_size + 1), generator=gen)


def _step(engine: Any, cfg: Any, step: int) -> None:
    data = _batch(cfg, step)
    engine.train_step(data[:, :-1], data[:, 1:])


def measure(cfg: Any, steps: int) -> dict[str, Any]:
    """One layout on this rank (every rank calls it with the same ``cfg``)."""
    from pycomm.parallel.train.loop import build

    torch.set_num_threads(cfg.threads)
    # The checkpointed inputs' arena is one per process and keeps its largest size: a
    # fresh one per layout, so each layout's own is counted.
    checkpoint_module._DEFAULT_ARENA = CheckpointArena()
    dist.barrier()
    gc.collect()
    base, rss0 = in_use(), proc_status()["VmRSS"]
    t0 = time.perf_counter()
    engine, _params, _name = build(cfg)
    built, t1 = in_use() - base, time.perf_counter()
    _step(engine, cfg, 1)
    t2 = time.perf_counter()
    with ProcessMeter() as process, PeakSampler() as sampler:
        _step(engine, cfg, 2)
    t3 = time.perf_counter()
    held = held_bytes(engine)
    times = _timed_steps(engine, cfg, range(3, steps + 1))
    pool = getattr(getattr(engine.stage, "zero3", None), "pool", None)
    out = {"rank": dist.get_rank(), "coords": list(engine.mesh.coordinates),
           "peak": sampler.peak - base, "after": sampler.after - base, "built": built,
           "held": held, "rss_peak_rise": process.rss_peak_rise,
           "rss_over_start": proc_status()["VmHWM"] - rss0 if process.rss_peak_rise >= 0
           else -1, "step_s": statistics.median(times) if times else None,
           "pool": pool.stats() if pool is not None else None,
           "seconds": {"build": t1 - t0, "first_step": t2 - t1, "sampled_step": t3 - t2},
           "loadavg": os.getloadavg()}
    engine.mesh.destroy()
    del engine
    gc.collect()
    return out


def _timed_steps(engine: Any, cfg: Any, steps: range) -> list[float]:
    """Seconds of each of ``steps``, every one between barriers (the slowest rank's)."""
    times = []
    for step in steps:
        dist.barrier()
        start = time.perf_counter()
        _step(engine, cfg, step)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def measure_time(cfg: Any, steps: int) -> dict[str, Any]:
    """One layout's step times alone (no sampling): a first step, then ``steps`` timed
    between barriers. Their minimum is the step least disturbed by other load."""
    from pycomm.parallel.train.loop import build

    torch.set_num_threads(cfg.threads)
    checkpoint_module._DEFAULT_ARENA = CheckpointArena()
    engine, _params, _name = build(cfg)
    _step(engine, cfg, 1)
    times = _timed_steps(engine, cfg, range(2, steps + 2))
    engine.mesh.destroy()
    del engine
    gc.collect()
    return {"rank": dist.get_rank(), "step_times": times, "loadavg": os.getloadavg()}


def run_all(rank: int, cfgs: list[Any], steps: int, out_path: str,
            time_only: bool = False) -> None:
    """Every layout in turn; rank 0 appends one JSON line per layout to ``out_path``.
    The first layout runs once unrecorded first: a process's first engine allocates
    for good what later ones reuse (torch's and pycomm's one-time state)."""
    run = measure_time if time_only else measure
    if cfgs:
        run(cfgs[0], 3)
    for cfg in cfgs:
        try:
            mine: dict[str, Any] = run(cfg, steps)
        except Exception:
            mine = {"rank": rank, "error": traceback.format_exc(limit=3)}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps({"layout": _layout(cfg), "ranks": ranks}) + "\n")


def _layout(cfg: Any) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("dp", "tp", "pp", "zero", "recompute",
                                         "partition_activations")}
