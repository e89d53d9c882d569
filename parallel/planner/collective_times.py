"""Collective times from the collective benchmark: pycomm's measured all-reduce time per
message size, interpolated between sizes. The installed planner reads the table shipped
with it (``parallel/planner/data/all_reduce.json``: seconds by ranks and bytes, and where
they were measured); ``--comm-results FOLDER`` reads a benchmark's summaries instead
(``mpirun-{N}r-fp32-barrier.json``: ``best.best_us["all_reduce|pycomm|<bytes>"]``, the
median over the jobs, in microseconds), and
``python -m pycomm.parallel.planner.collective_times FOLDER`` refreshes the shipped table
from them.

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

SHIPPED = Path(__file__).resolve().parent / "data" / "all_reduce.json"
KEY = "all_reduce|pycomm|"


def summary_tables(folder: str | Path) -> dict[int, list[tuple[int, float]]]:
    """(bytes, seconds) of each ranks' all-reduce from a benchmark's summaries.

    Raises:
        FileNotFoundError: no ``mpirun-<N>r-fp32-barrier.json`` summary there.
    """
    tables = {}
    for path in sorted(Path(folder).glob("mpirun-*r-fp32-barrier.json")):
        ranks = int(path.name.split("-")[1].rstrip("r"))
        best = json.loads(path.read_text())["best"]["best_us"]
        points = sorted((int(k[len(KEY):]), v[0] * 1e-6) for k, v in best.items()
                        if k.startswith(KEY))
        if points:
            tables[ranks] = points
    if not tables:
        raise FileNotFoundError(f"plan: no collective benchmark summaries "
                                f"(mpirun-<N>r-fp32-barrier.json) in {folder}")
    return tables


def shipped_tables(path: Path = SHIPPED) -> dict[int, list[tuple[int, float]]]:
    """The table installed with the planner (see the module docstring)."""
    data = json.loads(path.read_text())
    return {int(ranks): [(int(n), float(s)) for n, s in points]
            for ranks, points in data["seconds"].items()}


class CommModel:
    """All-reduce seconds by (ranks, bytes): the shipped table, or the summaries in
    ``folder`` (see the module docstring).

    Raises:
        FileNotFoundError: ``folder`` holds no ``mpirun-<N>r-fp32-barrier.json`` summary.
    """

    def __init__(self, folder: str | Path = ""):
        self.tables = summary_tables(folder) if folder else shipped_tables()

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

