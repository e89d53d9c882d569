"""``python -m pycomm.parallel.planner.refresh_collective_times FOLDER``: the planner's
shipped all-reduce table (:data:`pycomm.parallel.planner.collective_times.SHIPPED`)
written again from the collective benchmark's summaries in ``FOLDER`` (``python -m
bench.collectives`` runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .collective_times import SHIPPED, summary_tables


def refresh(folder: str | Path, out: Path = SHIPPED) -> Path:
    """Write the shipped table from the benchmark summaries in ``folder``."""
    tables = summary_tables(folder)
    data = {"source": f"{Path(folder).as_posix()}/mpirun-<N>r-fp32-barrier.json (bench."
                      "collectives: pycomm's all-reduce, fp32, the median over the jobs)",
            "seconds": {str(r): [[n, s] for n, s in points] for r, points in tables.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of mpirun-<N>r-fp32-barrier.json summaries")
    print(f"wrote {refresh(parser.parse_args().folder)}")
