"""Fitting a layout in a memory size: its predicted per-rank peak
(:mod:`pycomm.parallel.planner.memory`) against the limit, and with ZeRO-3 offload the two
settings that trade memory for overlap picked to fit: the read-ahead depth
(``--offload-prefetch``, from the one given down to 0: each unit read ahead is one more
record in memory) and, where the gathered units' pool is what does not fit, a live
budget (``--max-live-mb``) of the room the rest leaves it. The deepest read-ahead that
fits is taken first (the step time falls with it:
``records/offload/recipe-1b-overlap.md``), with the largest budget that fits
beside it. At ZeRO-3 (offloaded or not, tp = 1), where a layer outside the blocks (an
embedding, a head) is a larger unit than a block, splitting it into tiles no larger
than a block (``--max-unit-mb``, :mod:`pycomm.parallel.compose.tiles`) is tried too, before a
budget.

``pycomm.parallel.train --memory-gb`` without ``--plan auto`` checks the layout given this way
before any rank starts (:func:`fit_memory`: refused with its predicted peak, term by
term, where nothing fits); the planner's table and ``--plan auto`` give each offloaded
layout the settings that fit (:func:`fitting_job`).

A layout fits where its prediction leaves ``PREDICTION_MARGIN`` of the limit free: the
accuracy the tests hold the predictor to (``tests/test_plan_predictor.py``, within 10% of
a measured run), so a prediction off by that much still fits (the 1.1B recipe at
``--memory-gb 1.8`` without it: predicted 1.80 GiB a rank, OOM-killed at a cap of
2 x 1.8 GiB + 3 runtimes, measured 1.82; ``records/offload/recipe-1b-tiles-fit.md``).

The prediction counts what the layout holds beyond the process's runtime (the
interpreter, torch and the libraries it loads: a few hundred MiB a rank, the same for
every layout), as the planner's table does."""

from __future__ import annotations

import dataclasses
from typing import Any

from .layouts import Layout
from .memory import F32, GIB, Job, Memory, job_of, predict
from .shapes import ModelShape, model_shape

MIB = 1 << 20
PREDICTION_MARGIN = 0.10  # of the limit, kept free for the prediction's error


def layout_of(cfg: Any) -> Layout:
    """The layout the trainer's flags in ``cfg`` (a :class:`TrainConfig`) name."""
    return Layout(cfg.dp, cfg.tp, cfg.pp, cfg.zero, cfg.recompute, cfg.partition_activations,
                  cfg.offload, microbatches=cfg.effective_microbatches(), ep=cfg.ep)


def worst_rank(shape: ModelShape, layout: Layout, job: Job) -> Memory:
    """The predicted memory of the rank that needs the most."""
    return max(predict(shape, layout, job), key=lambda m: m.peak)


def fitting_job(shape: ModelShape, layout: Layout, job: Job, want: int) -> Job | None:
    """``job`` as it fits ``layout`` in ``want`` bytes per rank less the margin (itself
    where it does; at ZeRO-3 the tiles, and offloaded the read-ahead and budget, of the
    module docstring), or None."""
    want = usable(want)
    if worst_rank(shape, layout, job).peak <= want:
        return job
    if layout.zero != 3:
        return None
    offloaded = layout.offload != "none"
    for depth in range(job.prefetch, -1, -1) if offloaded else [job.prefetch]:
        trial = dataclasses.replace(job, prefetch=depth)
        tiled = _tiled(shape, layout, trial)
        candidates = [trial, tiled]
        if offloaded:
            candidates += [_budgeted(shape, layout, trial, want),
                           tiled and _budgeted(shape, layout, tiled, want)]
        for candidate in candidates:
            if candidate is not None and worst_rank(shape, layout, candidate).peak <= want:
                return candidate
    return None


def usable(limit: int) -> int:
    """The bytes of ``limit`` a prediction may take (:data:`PREDICTION_MARGIN` kept)."""
    return int(limit * (1 - PREDICTION_MARGIN))


def _tiled(shape: ModelShape, layout: Layout, job: Job) -> Job | None:
    """``job`` with the layers outside the blocks tiled to a block's size, where one is
    larger (None where none is, at tp > 1, or with ``max_unit_bytes`` given)."""
    blocks = [sum(p.numel for p in lay.params) for lay in shape.layers if lay.is_block]
    others = [p.numel for lay in shape.layers if not lay.is_block for p in lay.params]
    if layout.tp != 1 or job.max_unit_bytes or not blocks or max(others, default=0) <= max(
            blocks):
        return None
    return dataclasses.replace(job, max_unit_bytes=F32 * max(blocks))


def _budgeted(shape: ModelShape, layout: Layout, job: Job, want: int) -> Job | None:
    """``job`` with the live budget (whole MiB) the ZeRO-3 pool has room for beside the
    rest of its prediction (None where there is no room at all)."""
    mem = worst_rank(shape, layout, job)
    room = (want - (mem.peak - mem.buffers.get("zero3 pool", 0))) // MIB * MIB
    if room <= 0:
        return None
    if job.max_live_bytes:
        room = min(room, job.max_live_bytes)
    return dataclasses.replace(job, max_live_bytes=room)


def settings_of(job: Job) -> dict[str, float]:
    """The trainer's settings for ``job``'s read-ahead, budget and tiles."""
    tiles = {"max_unit_mb": job.max_unit_bytes / MIB} if job.max_unit_bytes else {}
    return {"offload_prefetch": job.prefetch, "max_live_mb": job.max_live_bytes / MIB, **tiles}


def describe(mem: Memory) -> str:
    """``mem``'s terms in GiB, the largest first (what a refusal names)."""
    terms = {"parameters": mem.params, "gradients": mem.grads, "optimizer state":
             mem.optimizer, **mem.buffers, **{f"experts' {k}": v for k, v in
                                             mem.experts.items()},
             "activations": max(mem.activations, mem.end_of_backward),
             "offload step pass": mem.step_pass}
    shown = sorted(((v, k) for k, v in terms.items() if v), reverse=True)
    return ", ".join(f"{k} {v / GIB:.2f}" for v, k in shown)


def fit_memory(cfg: Any, limit_gib: float) -> tuple[Any, Memory]:
    """``cfg`` (a :class:`TrainConfig`) as it fits in ``limit_gib`` per rank, and its
    predicted worst rank (see the module docstring).

    Raises:
        ValueError: nothing fits, naming the predicted peak and its terms (at the
            smallest settings tried); or a precision not modelled at this ZeRO stage.
    """
    if cfg.precision != "fp32" and cfg.zero != 3:
        raise ValueError(f"train: --memory-gb: precision {cfg.precision} is modelled at "
                         f"--zero 3 only (the planner cannot predict zero={cfg.zero}'s "
                         "memory in it); drop --memory-gb or use --zero 3")
    shape, layout, job = model_shape(cfg), layout_of(cfg), job_of(cfg)
    want = int(limit_gib * GIB)
    found = fitting_job(shape, layout, job, want)
    if found is not None:
        chosen = cfg if found == job else dataclasses.replace(cfg, **settings_of(found))
        return chosen, worst_rank(shape, layout, found)
    offloaded = layout.offload != "none" and layout.zero == 3
    least = dataclasses.replace(job, prefetch=0, max_live_bytes=MIB) if offloaded else job
    least = _tiled(shape, layout, least) or least
    smallest = worst_rank(shape, layout, least)
    tried = (" (at every --offload-prefetch from the one given to 0, with the smallest "
             "--max-live-mb)") if offloaded else ""
    if least.max_unit_bytes != job.max_unit_bytes:
        tried += f" with --max-unit-mb {least.max_unit_bytes / MIB:g}"
    raise ValueError(f"train: {layout} is predicted to need {smallest.peak / GIB:.2f} GiB "
                     f"per rank{tried}, more than --memory-gb {limit_gib:g} less "
                     f"{PREDICTION_MARGIN:.0%} for the prediction's error "
                     f"({usable(want) / GIB:.2f}): "
                     f"{describe(smallest)} (python -m pycomm.parallel.planner with the same flags "
                     "ranks the layouts that fit)")
