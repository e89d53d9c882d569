"""What each rank runs for tests/test_plan_predictor.py: one layout built by the
trainer's code and measured as bench.plan_accuracy measures it."""

from __future__ import annotations

from typing import Any


def measured(cfg: Any) -> dict[str, Any]:
    """The second of two runs (a process's first engine also allocates, for good, what
    every later one reuses: not the layout's)."""
    from bench._plan_accuracy_rank import measure

    measure(cfg, steps=2)  # (no timed steps: memory only)
    return measure(cfg, steps=2)


def refused_everywhere(cfg: Any) -> str:
    """What ``planned_everywhere`` raises on this rank ("" if it returned)."""
    from pycomm.parallel.train.auto import planned_everywhere

    try:
        planned_everywhere(cfg)
    except ValueError as err:
        return str(err)
    return ""
