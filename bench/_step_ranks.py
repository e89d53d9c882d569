"""Rank side of ``bench.step_time``: every backend's model of one layout in the same
ranks, taking turns in rounds (as ``bench.training data``), so machine noise hits all
of them alike.

A cell that cannot be built or stepped records why; the ranks agree on it (over a gloo
group) before going on, so that no rank waits in a collective its peer left.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from bench._step_layouts import (
    Step,
    Work,
    backend_groups,
    build_step,
    default_group,
    unsupported,
)
from bench._train_steps import _timed_steps


@dataclass(frozen=True)
class Timing:
    steps: int  # timed steps per cell per round
    rounds: int
    warmup: int  # untimed steps per cell before the first round


def _why(exc: BaseException) -> str:
    """An error's last line (a rank's failure arrives wrapped)."""
    lines = [ln for ln in traceback.format_exception_only(exc)[-1].splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:  # the row says why; the other cells go on
        return None, _why(exc)


def _agree(reason: str | None, gloo: dist.ProcessGroup) -> str | None:
    """Every rank's reason, so that all ranks drop a cell any rank failed."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reason, group=gloo)
    return next((r for r in everyone if r), None)


def _build(work: Work, layout: str, backends: list[str], gloo: dist.ProcessGroup
           ) -> tuple[dict[str, tuple[Step, Any]], dict[str, str]]:
    """Each backend's step (with the group it runs under), or why not."""
    steps: dict[str, tuple[Step, Any]] = {}
    reasons: dict[str, str] = {}
    for b in backends:
        reason = unsupported(layout, b)
        if reason is None:
            world, single = backend_groups(b)
            with default_group(world):
                step, reason = _attempt(partial(build_step, work, layout, world, single))
        if (reason := _agree(reason, gloo)) is None:
            steps[b] = (step, world)
        else:
            reasons[b] = reason
    return steps, reasons


def time_cells(work: Work, layout: str, backends: list[str], timing: Timing
               ) -> dict[str, Any]:
    """Per backend: each round's step times on this rank (seconds), or why it has none.
    The job's thread count is the rank's own (set before torch's pool first ran: one
    process switching counts between cells slowed the 1-thread cells 2-3x)."""
    # Fake collectives leave outputs as local copies or untouched; flushing denormals
    # (for every backend alike) keeps such values from slowing the maths of one cell.
    torch.set_flush_denormal(True)
    gloo = dist.new_group(backend="gloo")  # barriers and agreement, whatever the cell
    steps, reasons = _build(work, layout, backends, gloo)
    cells = list(steps)
    done = dict.fromkeys(steps, 0)  # steps taken by each backend's model (its batch index)
    rounds: dict[str, list[list[float]]] = {b: [] for b in cells}

    def turn(b: str, count: int) -> list[float]:
        if b in reasons:
            return []
        step, world = steps[b]
        dist.barrier(gloo)
        with default_group(world):
            times, reason = _attempt(lambda: _timed_steps(step, done[b], count))
        done[b] += count
        if (reason := _agree(reason, gloo)) is not None:
            reasons[b] = f"failed stepping: {reason}"
            return []
        return list(times)

    for b in cells:
        turn(b, timing.warmup)
    for r in range(timing.rounds):
        for b in cells[r % len(cells):] + cells[: r % len(cells)] if cells else []:
            if times := turn(b, timing.steps):
                rounds[b].append(times)
    return {"rounds_s": {b: v for b, v in rounds.items() if b not in reasons},
            "reasons": reasons, "threads": torch.get_num_threads()}
