"""Pipeline schedules as pure functions: for each stage, the order of its steps.

A step is ``F`` (forward) or ``B`` (backward) of one micro-batch. Every stage runs its
own list in order; a stage's ``F m`` waits for stage ``s - 1``'s ``F m``, its ``B m`` for
stage ``s + 1``'s ``B m``. Drawn for M = 4 micro-batches over K = 3 stages, one column
per time slot (each step taking one slot):

GPipe (all forwards, then all backwards, last micro-batch first)::

    stage 0 | F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
    stage 1 | .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
    stage 2 | .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

The backward of the last micro-batch starts as soon as its forward ends, so GPipe can
skip re-materializing that one ("except_last" checkpointing). Every stage holds the
activations of all M micro-batches at the turn.

1F1B (PipeDream-flush: K - 1 - s warm-up forwards, then one forward and one backward in
turn, then the remaining backwards)::

    stage 0 | F0 F1 F2 .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 ..

(slots are approximate: a backward takes about twice a forward). Stage ``s`` holds at
most ``K - s`` micro-batches of activations, not M; the bubble is the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    kind: str  # "F" or "B"
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def _check(num_micro: int, num_stages: int) -> None:
    if num_micro < 1 or num_stages < 1:
        raise ValueError(f"pipeline schedule: need at least one micro-batch and one stage, "
                         f"got M={num_micro}, K={num_stages}")


def gpipe_schedule(num_micro: int, num_stages: int) -> list[list[Step]]:
    """Per stage: F 0..M-1, then B M-1..0."""
    _check(num_micro, num_stages)
    forwards = [Step("F", m) for m in range(num_micro)]
    backwards = [Step("B", m) for m in reversed(range(num_micro))]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b_schedule(num_micro: int, num_stages: int) -> list[list[Step]]:
    """Per stage ``s``: ``min(K - 1 - s, M)`` forwards, then F and B in turn, then the
    remaining backwards (micro-batches in order throughout)."""
    _check(num_micro, num_stages)
    out = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_micro)
        steps = [Step("F", m) for m in range(warmup)]
        for i in range(num_micro - warmup):
            steps += [Step("F", warmup + i), Step("B", i)]
        steps += [Step("B", m) for m in range(num_micro - warmup, num_micro)]
        out.append(steps)
    return out


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def in_flight(steps: list[Step]) -> int:
    """Most micro-batches whose forward has run and backward has not, at any point."""
    live = peak = 0
    for step in steps:
        live += 1 if step.kind == "F" else -1
        peak = max(peak, live)
    return peak
