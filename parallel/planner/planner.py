"""The planner itself: every layout the trainer accepts, its predicted per-rank memory
and step time, whether it fits, and the best one (``pycomm.parallel.train --plan auto``).
(Not :mod:`pycomm.parallel.plans.plan`, which is a model's module-path plan.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .calibrate import Calibration
from .collective_times import CommModel
from .fit import fitting_job, settings_of
from .layouts import OFFLOADS, Layout, enumerate_layouts
from .memory import GIB, Memory, job_of, predict
from .shapes import ModelShape, model_shape
from .timing import StepTime, predict_time


@dataclass
class Row:
    """One layout's prediction: each pipeline stage's per-rank memory, the step time."""

    layout: Layout
    memory: list[Memory]
    time: StepTime
    fits: bool
    # the trainer's settings it fits with, where not those given (offload's read-ahead
    # and live budget, :func:`pycomm.parallel.planner.fit.fitting_job`)
    settings: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        picked = ", ".join(f"{k} {v:g}" for k, v in self.settings.items())
        return f"{self.layout} ({picked})" if picked else str(self.layout)

    @property
    def peak(self) -> int:
        """The most bytes any rank needs."""
        return max(m.peak for m in self.memory)

    @property
    def worst(self) -> Memory:
        return max(self.memory, key=lambda m: m.peak)


def evaluate(cfg: Any, world: int, memory_gib: float, calibration: str = "",
             comm_results: str = "", offloads: tuple[str, ...] = OFFLOADS,
             shape: ModelShape | None = None, other_load: float = 0.0
             ) -> tuple[list[Row], list[tuple[Layout, str]]]:
    """Every accepted layout's prediction, those that fit first by predicted step time,
    then those that do not by memory; and the refused layouts with why. An offloaded
    ZeRO-3 layout that does not fit with the read-ahead and budget given is predicted
    with those that fit where there are (``Row.settings``). ``other_load``: runnable
    processes beside the job (they share the CPUs with its ranks)."""
    shape = shape or model_shape(cfg)
    job = job_of(cfg)
    cal, comm = Calibration(calibration, cfg.threads), CommModel(comm_results)
    layouts, refused = enumerate_layouts(cfg, world, shape, offloads)
    rows = []
    for layout in layouts:
        fitted = fitting_job(shape, layout, job, int(memory_gib * GIB))
        used = fitted or job
        mems = predict(shape, layout, used)
        time = predict_time(shape, layout, used, mems, cal, comm, cfg.threads, other_load)
        settings = settings_of(used) if used != job else {}
        rows.append(Row(layout, mems, time, fitted is not None, settings))
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
