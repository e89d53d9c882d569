"""Collective times from the collective benchmark's committed summaries: pycomm's
measured all-reduce time per message size (``bench/results/i30/mpirun-{N}r-fp32-barrier
.json``: ``best.best_us["all_reduce|pycomm|<bytes>"]``, the median over the jobs, in
microseconds), interpolated between sizes.

The benchmark measured all-reduce only; the other collectives follow from the ring
(Patarasuk and Yuan 2009): an all-reduce is a reduce-scatter then an all-gather, each
moving the same ``(N-1)/N`` of the bytes, so either costs half an all-reduce of the
same bytes; a point-to-point send of ``n`` bytes costs half a 2-rank all-reduce of them
(which moves them once each way).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "bench" / "results" / "i30"
KEY = "all_reduce|pycomm|"


class CommModel:
    """All-reduce seconds by (ranks, bytes), from the summaries in ``folder``.

    Raises:
        FileNotFoundError: no ``mpirun-<N>r-fp32-barrier.json`` summary there.
    """

    def __init__(self, folder: str | Path = ""):
        folder = Path(folder) if folder else DEFAULT_DIR
        self.tables: dict[int, list[tuple[int, float]]] = {}
        for path in sorted(folder.glob("mpirun-*r-fp32-barrier.json")):
            ranks = int(path.name.split("-")[1].rstrip("r"))
            best = json.loads(path.read_text())["best"]["best_us"]
            points = sorted((int(k[len(KEY):]), v[0] * 1e-6) for k, v in best.items()
                            if k.startswith(KEY))
            if points:
                self.tables[ranks] = points
        if not self.tables:
            raise FileNotFoundError(f"plan: no collective benchmark summaries "
                                    f"(mpirun-<N>r-fp32-barrier.json) in {folder}")

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds for one all-reduce of ``nbytes`` over ``ranks`` (0 for one rank)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        measured = min(self.tables, key=lambda n: (abs(n - ranks), n))
        # another group size: the ring's per-rank traffic 2(N-1)/N scales the time
        scale = (2 * (ranks - 1) / ranks) / (2 * (measured - 1) / measured)
        return scale * _interpolate(self.tables[measured], nbytes)

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        return self.all_reduce(nbytes, ranks) / 2

    def all_gather(self, nbytes: float, ranks: int) -> float:
        return self.all_reduce(nbytes, ranks) / 2

    def send(self, nbytes: float) -> float:
        return self.all_reduce(nbytes, 2) / 2


def _interpolate(points: list[tuple[int, float]], nbytes: float) -> float:
    """Log-log between measured sizes; below the smallest its time (latency); above the
    largest, its bandwidth."""
    sizes = [s for s, _ in points]
    if nbytes <= sizes[0]:
        return points[0][1]
    if nbytes >= sizes[-1]:
        return points[-1][1] * nbytes / sizes[-1]
    i = bisect.bisect_left(sizes, nbytes)
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
