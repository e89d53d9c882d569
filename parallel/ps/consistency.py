"""When a pull may be answered: the job's consistency model over vector clocks.

A worker's clock counts the steps it has finished (``kv.clock()`` after pushing a step's
gradients). A server keeps every worker's clock (the vector clock of the ranges it holds:
every worker reports to every server, so all its ranges share one). A pull made at clock
``c`` is answered

- ``bsp`` (sequential): once every live worker has finished step ``c - 1`` and the
  gradients of those steps are applied (aggregated, one update per step and key);
- ``ssp`` (bounded delay ``tau``): once the slowest live worker has finished step
  ``c - tau - 1``: no worker runs more than ``tau`` steps ahead of the slowest;
- ``async`` (eventual): at once.
"""

from __future__ import annotations

MODES = ("bsp", "ssp", "async")


class VectorClock:
    def __init__(self, workers: int):
        self.finished = dict.fromkeys(range(workers), 0)
        self.live = set(range(workers))

    def advance(self, worker: int, clock: int) -> None:
        self.finished[worker] = max(self.finished[worker], clock)

    def floor(self) -> int:
        """The step every live worker has finished (all finished steps < floor)."""
        return min((self.finished[w] for w in self.live), default=1 << 62)

    def as_dict(self) -> dict[str, int]:
        return {str(w): c for w, c in self.finished.items()}


class Gate:
    def __init__(self, mode: str, tau: int = 0):
        if mode not in MODES:
            raise ValueError(f"consistency must be one of {MODES}, got {mode!r}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.mode, self.tau = mode, tau

    @property
    def aggregates(self) -> bool:
        """BSP sums a step's pushes and applies them once the step is complete."""
        return self.mode == "bsp"

    def may_answer(self, clock: int, vc: VectorClock) -> bool:
        if self.mode == "async":
            return True
        lag = 0 if self.mode == "bsp" else self.tau
        return vc.floor() >= clock - lag
