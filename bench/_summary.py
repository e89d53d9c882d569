"""A table's numbers from fresh jobs' raw files: medians and ranges over the jobs, ratios
taken inside each job, the best Open MPI configuration per size (single copy on or off)
and every backend's best setting (bench._best). ``bench._jobs`` runs the jobs and prints
this; ``python -m bench.tables --rebuild`` makes a committed summary again from its raw
files by today's rules.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench import _best

NOCMA = "mpi-nocma"
UNPINNED = "@unpinned"
BEST_MPI = "mpi-best"


def remake(path: Path) -> dict:
    """A summary made again from the raw files it lists, by today's code (the limit
    model, the best-of rules); nothing is written."""
    old = json.loads(path.read_text())
    jobs = [[load_doc(json.loads((path.parent / name).read_text()), "") for name in names]
            for names in old["runs"]]
    summary = summarize(jobs)
    summary["runs"] = old["runs"]
    return summary


def resummarize(path: Path) -> dict:
    """:func:`remake`, written back in place."""
    summary = remake(path)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def relabel(label: str, suffix: str) -> str:
    """A backend's label in a run: mpi is mpi-nocma in the no-CMA run, and every label of
    an unpinned run ends in @unpinned."""
    if ".nocma" in suffix and label == "mpi":
        label = NOCMA
    if suffix.endswith(UNPINNED) and not label.endswith(UNPINNED):
        label += UNPINNED
    return label


def load_doc(doc: dict, suffix: str) -> dict:
    if doc["meta"].get("relabelled"):
        return doc
    for row in doc["results"]:
        row["backend"] = relabel(row["backend"], suffix)
    doc["meta"]["backends"] = [relabel(b, suffix) for b in doc["meta"]["backends"]]
    doc["meta"]["relabelled"] = suffix or "main"
    return doc


def _ratios(doc: dict, first: str) -> dict[tuple[str, str, int], float]:
    """{(op, other, bytes): time(first) / time(other)} inside one run."""
    rows = {(r["op"], r["backend"], r["bytes"]): r for r in doc["results"]}
    out = {}
    for (op, b, n), r in rows.items():
        mine = rows.get((op, first, n))
        if b != first and mine is not None and r["time_us"] > 0:
            out[(op, b, n)] = mine["time_us"] / r["time_us"]
    return out


def summarize(jobs: list[list[dict]]) -> dict:
    """Medians and ranges over the jobs: times per (op, backend, bytes), ratios of the
    first backend to each other one, the best Open MPI configuration, c2c readings."""
    first = jobs[0][0]["meta"]["backends"][0]
    times: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    limits: dict[tuple, list[float]] = {}
    for docs in jobs:
        for doc in docs:
            for r in doc["results"]:
                if doc is docs[0] or r["backend"] != first:  # the first backend: main run
                    times.setdefault((r["op"], r["backend"], r["bytes"]), []).append(r["time_us"])
            for key, v in _ratios(doc, first).items():
                ratios.setdefault(key, []).append(v)
        for op, per in docs[0].get("limit", {}).get("limit_busbw", {}).items():
            for n, v in per.items():
                limits.setdefault((op, int(n)), []).append(v)
    wins = _add_best_mpi(jobs, first, times, ratios)
    cells = {"|".join(map(str, k)): _spread(v) for k, v in times.items()}
    return {
        "first": first,
        "jobs": len(jobs),
        "meta": jobs[0][0]["meta"],
        "backends": _backend_order(jobs, times),
        "time_us": cells,
        "ratio": {"|".join(map(str, k)): _spread(v) for k, v in ratios.items()},
        "limit_busbw": {f"{op}|{n}": _spread(v) for (op, n), v in limits.items()},
        "c2c": [[(d["meta"].get("provenance") or {}).get(f"c2c_{w}") for w in ("before", "after")]
                for docs in jobs for d in docs],
        "wrong": sum(d["meta"].get("wrong", 0) for docs in jobs for d in docs),
        "mpi_best_won_by": {"|".join(map(str, k)): v for k, v in wins.items()},
        "best": _best.summarize(jobs, _best.family(first)),
        "load": jobs[0][0]["meta"].get("load"),
    }


def _add_best_mpi(jobs: list[list[dict]], first: str, times: dict, ratios: dict
                  ) -> dict[tuple[str, int], dict[str, int]]:
    """Per job and size, the faster of mpi and mpi-nocma and its ratio (into ``times``
    and ``ratios``); returns {(op, bytes): {winner: jobs won}}."""
    wins: dict[tuple[str, int], dict[str, int]] = {}
    for docs in jobs:
        rows = {}
        for doc in docs:
            for r in doc["results"]:
                rows[(r["op"], r["backend"], r["bytes"])] = r
        run_ratios = {}
        for doc in docs:
            run_ratios.update(_ratios(doc, first))
        for (op, b, n), r in list(rows.items()):
            if b != "mpi" or (op, NOCMA, n) not in rows:
                continue
            other = rows[(op, NOCMA, n)]
            win = "mpi" if r["time_us"] <= other["time_us"] else NOCMA
            best = min(r["time_us"], other["time_us"])
            times.setdefault((op, BEST_MPI, n), []).append(best)
            ratios.setdefault((op, BEST_MPI, n), []).append(run_ratios[(op, win, n)])
            per = wins.setdefault((op, n), {})
            per[win] = per.get(win, 0) + 1
    return wins


def _backend_order(jobs: list[list[dict]], times: dict) -> list[str]:
    order: list[str] = []
    for docs in jobs:
        for doc in docs:
            order += [b for b in doc["meta"]["backends"] if b not in order]
    if any(k[1] == BEST_MPI for k in times):
        order.append(BEST_MPI)
    return order


def _spread(values: list[float]) -> list[float]:
    """[median, min, max, count]."""
    return [statistics.median(values), min(values), max(values), len(values)]
