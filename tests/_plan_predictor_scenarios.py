"""What each rank runs for tests/test_plan_predictor.py: one layout built by the
trainer's code and measured as bench.plan_accuracy measures it."""

from __future__ import annotations

from typing import Any


def measured(cfg: Any) -> dict[str, Any]:
    from bench._plan_accuracy_rank import measure

    return measure(cfg, steps=3)
