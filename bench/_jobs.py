"""``--jobs K`` and ``--mpi-tuned``: fresh jobs, then one table of medians and ranges.

One job's numbers carry that job's luck: where its ranks landed, the cache state it
met, its segments' placement. So each of K jobs is a fresh ``python -m bench.collectives``
(new processes, new groups, under mpirun again when mpi is a backend), its JSON kept as
``OUT.jobN.json``; each cell of the final table is the median of the K, with its range.
Ratios are taken inside each job (both backends met the same machine) and then summarised.

With ``--mpi-tuned`` every job runs twice: as launched (Open MPI's shared-memory BTL with
its single-copy mechanism, CMA) and with single copy off
(``--mca btl_vader_single_copy_mechanism none``, faster for small messages here). The
second run times the first backend and mpi only; its mpi column is "mpi-nocma", and the
table adds the best of the two per size, naming which won.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench import _best, _load

NOCMA = "mpi-nocma"
UNPINNED = "@unpinned"
NOCMA_MCA = "--mca btl_vader_single_copy_mechanism none"
BEST_MPI = "mpi-best"


def _strip(argv: list[str], flag: str, takes_value: bool) -> list[str]:
    """argv without ``flag`` (and its value), in either '--f v' or '--f=v' form."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = takes_value
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _variants(argv: list[str], args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(suffix, argv) of the runs each job makes."""
    base = argv
    for flag, takes in (("--jobs", True), ("--out", True), ("--mpi-tuned", False),
                        ("--tuned", False), ("--load", True), ("--load-kind", True)):
        base = _strip(base, flag, takes)
    if args.tuned:  # the children get the variants spelled out, not --tuned
        labels = [b for b in args.backends if "#" not in b]
        base = _strip(base, "--backends", True) + ["--backends", ",".join(labels)]
    runs = [("", base)]
    if args.mpi_tuned:
        first = args.backends[0].split("#")[0]
        tuned = _strip(_strip(_strip(base, "--backends", True), "--mpirun-args", True), "--aa",
                       False)
        tuned += ["--backends", f"{first},mpi", "--mpirun-args", f"{args.mpirun_args} {NOCMA_MCA}"]
        runs.append((".nocma", tuned))
    if args.tuned:
        runs = [(suffix + pin, _strip(run, "--bind", True) + ["--bind", mode])
                for suffix, run in runs for pin, mode in (("", "core"), (UNPINNED, "none"))]
    return runs


def run_jobs(argv: list[str], args: argparse.Namespace) -> int:
    """Run the jobs one after another (each under --load's competing processes), then
    print and write the summary; the exit status is the first failing job's, else 0."""
    failed = 0
    jobs: list[list[dict]] = []
    files: list[list[str]] = []
    for k in range(1, args.jobs + 1):
        docs, names = [], []
        with _load.competing(args.load, args.load_kind):
            for suffix, run_argv in _variants(argv, args):
                out = args.out.with_name(f"{args.out.stem}.job{k}{suffix}.json")
                # A run that fails must not leave an earlier run's file to be summarised.
                out.unlink(missing_ok=True)
                cmd = [sys.executable, "-m", "bench.collectives", *run_argv, "--out", str(out)]
                print(f"# job {k}/{args.jobs}{suffix}: {shlex.join(cmd)}", file=sys.stderr,
                      flush=True)
                rc = subprocess.run(cmd, check=False).returncode
                if rc and args.require_all:  # a summary short of a peer is not written
                    print(f"# job {k}{suffix} failed (exit {rc}): no summary written to "
                          f"{args.out}", file=sys.stderr)
                    return rc
                failed = failed or rc
                if out.exists():
                    docs.append(_load_run(out, suffix, args))
                    names.append(out.name)
        jobs.append(docs)
        files.append(names)
    if not any(jobs):
        print(f"# every run failed: no summary written to {args.out}", file=sys.stderr)
        return failed
    summary = summarize([docs for docs in jobs if docs])
    summary["runs"] = files  # each job's raw files, beside the summary
    for line in format_summary(summary):
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"# wrote {args.out} (each job's JSON beside it)")
    return failed


def remake(path: Path) -> dict:
    """A summary made again from the raw files it lists, by today's code (the limit
    model, the best-of rules); nothing is written."""
    old = json.loads(path.read_text())
    jobs = [[_load_doc(json.loads((path.parent / name).read_text()), "") for name in names]
            for names in old["runs"]]
    summary = summarize(jobs)
    summary["runs"] = old["runs"]
    return summary


def resummarize(path: Path) -> dict:
    """:func:`remake`, written back in place."""
    summary = remake(path)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def _load_run(path: Path, suffix: str, args: argparse.Namespace) -> dict:
    """One run's JSON, its backends relabelled by the run that made them, and the job's
    load recorded in it."""
    doc = _load_doc(json.loads(path.read_text()), suffix)
    doc["meta"]["load"] = {"per_cpu": args.load, "kind": args.load_kind if args.load else None}
    path.write_text(json.dumps(doc, indent=1))  # the raw file says what it is by itself
    return doc


def relabel(label: str, suffix: str) -> str:
    """A backend's label in a run: mpi is mpi-nocma in the no-CMA run, and every label of
    an unpinned run ends in @unpinned."""
    if ".nocma" in suffix and label == "mpi":
        label = NOCMA
    if suffix.endswith(UNPINNED) and not label.endswith(UNPINNED):
        label += UNPINNED
    return label


def _load_doc(doc: dict, suffix: str) -> dict:
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


def format_summary(s: dict) -> list[str]:
    """Per op: each backend's time median [min-max] over the jobs, then the first
    backend's ratio to each other one (median [min-max]); < 1 means the first is faster."""
    first, backends = s["first"], s["backends"]
    others = [b for b in backends if b != first]
    ops = sorted({k.split("|")[0] for k in s["time_us"]})
    meta = s["meta"]
    lines = [f"# summary of {s['jobs']} fresh jobs: {meta['nproc']} ranks, {meta['datatype']}, "
             f"-n {meta['iters']}, timing {meta.get('timing', 'barrier')}; cell = median "
             "[min-max] over the jobs; ratio = time(first)/time(other) inside each job"]
    for i, (before, after) in enumerate(s["c2c"]):
        lines.append(f"#   run {i + 1}: c2c before {_c2c_text(before)}, after {_c2c_text(after)}")
    for op in ops:
        sizes = sorted({int(k.split("|")[2]) for k in s["time_us"] if k.startswith(op + "|")})
        lines.append(f"# op: {op}   time(us)")
        lines.append(f"# {'size':>10} " + "".join(f"| {b:>22} " for b in backends)
                     + "".join(f"| {first + '/' + b:>22} " for b in others) + "| limit busbw")
        for n in sizes:
            cells = [_cell(s["time_us"].get(f"{op}|{b}|{n}")) for b in backends]
            rat = [_cell(s["ratio"].get(f"{op}|{b}|{n}"), ratio=True) for b in others]
            winner = _winner(s, op, n)
            if winner and BEST_MPI in backends:
                cells[backends.index(BEST_MPI)] = cells[backends.index(BEST_MPI)][:-1] + winner
            lim = (s.get("best") or {}).get("limit_busbw", {}).get(f"{op}|{n}") or \
                s["limit_busbw"].get(f"{op}|{n}")
            lines.append(f"  {n:>10} " + "".join(f"| {c:>22} " for c in cells)
                         + "".join(f"| {c:>22} " for c in rat)
                         + (f"| {lim[0]:6.2f}" if lim else ""))
    if s.get("best"):
        from bench import tables

        lines.append("# every backend at its best (bench._best), as markdown:")
        lines += [f"#   {line}" for op in ops for line in tables.table(s, op)]
    lines.append(f"# Out of bounds values : {s['wrong']} {'OK' if s['wrong'] == 0 else 'FAILED'}")
    return lines


def _winner(s: dict, op: str, n: int) -> str:
    """'c' when CMA won this size in most jobs, 'n' when no-CMA did; '' without both."""
    won = s["mpi_best_won_by"].get(f"{op}|{n}", {})
    if not won:
        return ""
    return "c" if won.get("mpi", 0) >= won.get(NOCMA, 0) else "n"


def _cell(v: list[float] | None, ratio: bool = False) -> str:
    if v is None:
        return "-"
    fmt = "{:.2f}" if ratio or v[0] < 100 else "{:.0f}"
    return f"{fmt.format(v[0])} [{fmt.format(v[1])}-{fmt.format(v[2])}] "


def _c2c_text(r: dict | None) -> str:
    if not r:
        return "n/a"
    return f"{r['round_trip_ns']:.0f} ns {r['handoff_gbs']:.1f} GB/s ({r['state']})"
