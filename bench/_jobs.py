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
import subprocess
import sys
from pathlib import Path

from bench import _load
from bench._summary import BEST_MPI, NOCMA, UNPINNED, load_doc, summarize

NOCMA_MCA = "--mca btl_vader_single_copy_mechanism none"


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


def _load_run(path: Path, suffix: str, args: argparse.Namespace) -> dict:
    """One run's JSON, its backends relabelled by the run that made them, and the job's
    load recorded in it."""
    doc = load_doc(json.loads(path.read_text()), suffix)
    doc["meta"]["load"] = {"per_cpu": args.load, "kind": args.load_kind if args.load else None}
    path.write_text(json.dumps(doc, indent=1))  # the raw file says what it is by itself
    return doc


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
    both = f"/{r['exchange_gbs']:.1f}" if r.get("exchange_gbs") else ""
    return f"{r['round_trip_ns']:.0f} ns {r['handoff_gbs']:.1f}{both} GB/s ({r['state']})"
