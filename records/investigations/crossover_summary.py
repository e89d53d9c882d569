"""Summarises fresh jobs of ``bench.algo_crossover`` as one table per op: per size, the
median and range over the jobs of each variant's time over the first variant's (each
job's ratio taken inside the job), and the first variant's own time.

Example::

    python -m records.investigations.crossover_summary records/collectives/two-shot/rs-ag
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

DASH = "\u2013"  # the tables' range dash


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}{DASH}{max(values):{fmt}})"


def table(jobs: list[dict]) -> list[str]:
    """The markdown table of jobs that ran the same variants over the same sizes."""
    names = list(jobs[0]["variants"])
    first = names[0]
    lines = ["| size | " + " | ".join(f"{n}/{first}" for n in names[1:]) + f" | {first} µs |",
             "|---|" + "---|" * len(names)]
    for i, row in enumerate(jobs[0]["rows"]):
        ratios = [_spread([j["rows"][i][n] / j["rows"][i][first] for j in jobs], ".2f")
                  for n in names[1:]]
        own = _spread([j["rows"][i][first] for j in jobs], ".0f")
        lines.append(f"| {_size(row['bytes'])} | " + " | ".join(ratios) + f" | {own} |")
    return lines


def summary(folder: str) -> str:
    by_op: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            job = json.load(f)
        by_op.setdefault(job.get("op", "all_reduce"), []).append(job)
    out = []
    for op, jobs in by_op.items():
        out += [f"{op}: {len(jobs)} jobs, {jobs[0]['nproc']} ranks; median (min{DASH}max) over the "
                "jobs of each job's ratio", "", *table(jobs), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m records.investigations.crossover_summary",
                                description=__doc__)
    p.add_argument("folder", help="a folder of bench.algo_crossover --out files")
    print(summary(p.parse_args(argv).folder), end="")


if __name__ == "__main__":
    main()
