"""The planner itself: every layout the trainer accepts, its predicted per-rank memory
and step time, whether it fits, and the best one (``parallel.train --plan auto``).
(Not :mod:`parallel.compose.plan`, which is a model's module-path plan.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel.plan.calibrate import Calibration
from parallel.plan.comms import CommModel
from parallel.plan.layouts import OFFLOADS, Layout, enumerate_layouts
from parallel.plan.memory import Job, Memory, predict
from parallel.plan.shapes import ModelShape, model_shape
from parallel.plan.timing import StepTime, predict_time

GIB = 1 << 30


@dataclass
class Row:
    """One layout's prediction: each pipeline stage's per-rank memory, the step time."""

    layout: Layout
    memory: list[Memory]
    time: StepTime
    fits: bool

    @property
    def peak(self) -> int:
        """The most bytes any rank needs."""
        return max(m.peak for m in self.memory)

    @property
    def worst(self) -> Memory:
        return max(self.memory, key=lambda m: m.peak)


def job_of(cfg: Any) -> Job:
    if cfg.precision != "fp32":
        raise ValueError(f"plan: precision {cfg.precision!r} is not modelled (the "
                         "predictions are for fp32 parameters, gradients and activations)")
    return Job(cfg.batch_size, cfg.bucket_mb, cfg.schedule, cfg.sequence_parallel,
               cfg.dropout, getattr(cfg, "offload_prefetch", 2), bool(cfg.max_grad_norm),
               int(getattr(cfg, "max_live_mb", 0.0) * 2**20))


def evaluate(cfg: Any, world: int, memory_gib: float, calibration: str = "",
             comm_results: str = "", offloads: tuple[str, ...] = OFFLOADS,
             shape: ModelShape | None = None, other_load: float = 0.0
             ) -> tuple[list[Row], list[tuple[Layout, str]]]:
    """Every accepted layout's prediction, those that fit first by predicted step time,
    then those that do not by memory; and the refused layouts with why. ``other_load``:
    runnable processes beside the job (they share the CPUs with its ranks)."""
    shape = shape or model_shape(cfg)
    job = job_of(cfg)
    cal, comm = Calibration(calibration, cfg.threads), CommModel(comm_results)
    layouts, refused = enumerate_layouts(cfg, world, shape, offloads)
    rows = []
    for layout in layouts:
        mems = predict(shape, layout, job)
        time = predict_time(shape, layout, job, mems, cal, comm, cfg.threads, other_load)
        rows.append(Row(layout, mems, time, max(m.peak for m in mems) <= memory_gib * GIB))
    rows.sort(key=lambda r: (not r.fits, r.time.total if r.fits else r.peak))
    return rows, refused


def choose(cfg: Any, world: int, memory_gib: float, **options: Any) -> Row:
    """The fastest predicted layout that fits.

    Raises:
        ValueError: no layout fits in ``memory_gib`` (naming the smallest one's need).
    """
    rows, _ = evaluate(cfg, world, memory_gib, **options)
    if not rows:
        raise ValueError(f"plan: no layout of {world} ranks is accepted for this model")
    if not rows[0].fits:
        least = min(rows, key=lambda r: r.peak)
        raise ValueError(f"plan: no layout of {world} ranks fits in {memory_gib:g} GiB per "
                         f"rank; the smallest, {least.layout}, needs "
                         f"{least.peak / GIB:.3f} GiB")
    return rows[0]
