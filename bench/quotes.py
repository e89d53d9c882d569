"""The figures the README quotes, computed from committed summaries only.

    python -m bench.quotes                  # every quote, as the README must spell it
    python -m bench.quotes --write-readme   # put them in the README

Each quote stands in the README between two invisible markers,
``<!-- q:NAME -->PHRASE<!-- /q -->``; tests/test_readme_figures.py recomputes every phrase
from ``records/collectives/`` and fails when the README says anything else there. After a
benchmark's results land, ``--write-readme`` rewrites the phrases (bench/run_tables.sh does it
with the tables, so results never land without the figures quoted from them).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from bench import _best
from bench.tables import machine
from bench.tables import size_label as _size

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "records" / "collectives"
STEP_TIMES = ROOT / "records" / "step-time"  # bench.step_time's committed runs

DASH, TIMES = "\u2013", "\u00d7"  # the README's typography


def _summary(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _per_size(s: dict, key: str, fam: str, op: str = "all_reduce") -> dict[int, list[float]]:
    """{bytes: [median, min, max, n]} of one family's entry of ``s['best'][key]``."""
    prefix = f"{op}|{fam}|"
    return {int(k.split("|")[2]): v for k, v in s["best"][key].items() if k.startswith(prefix)}


def speedup_over(name: str, peer: str, fam: str = "pycomm") -> str:
    """'A-Bx': the peer's best time over pycomm's, per size (medians over the jobs)."""
    s = _summary(name)
    mine, theirs = _per_size(s, "best_us", fam), _per_size(s, "best_us", peer)
    ratios = [theirs[n][0] / mine[n][0] for n in mine if n in theirs]
    return f"{min(ratios):.0f}{DASH}{max(ratios):.0f}{TIMES}"


def ahead_from(name: str, fam: str) -> str:
    """'at or ahead of the best peer from SIZE to 64 MB (a-bx its time)': the smallest
    size from which every larger size's median ratio to the best peer is at most 1."""
    ratios = _per_size(_summary(name), "vs_best_peer", fam)
    sizes = sorted(ratios)
    start = None
    for n in reversed(sizes):
        if ratios[n][0] > 1.0:
            break
        start = n
    if start is None:
        return "behind the best peer at the largest size"
    held = [ratios[n][0] for n in sizes if n >= start]
    return (f"at or ahead of the best peer from {_size(start)} to {_size(sizes[-1])} "
            f"({min(held):.2f}{DASH}{max(held):.2f}{TIMES} its time)")


def behind_below(name: str, fam: str) -> str:
    """'within a-bx of the best peer below SIZE' for the sizes before ahead_from's."""
    ratios = _per_size(_summary(name), "vs_best_peer", fam)
    sizes = sorted(ratios)
    ahead = [n for n in sizes if all(ratios[m][0] <= 1.0 for m in sizes if m >= n)]
    below = [ratios[n][0] for n in sizes if not ahead or n < ahead[0]]
    if not below:
        return "behind it at no size"
    edge = _size(ahead[0]) if ahead else "the largest size"
    span = (f"{below[0]:.2f}" if len(below) == 1
            else f"{min(below):.2f}{DASH}{max(below):.2f}")
    return f"{span}{TIMES} the best peer's time below {edge}"


def limit_fraction(name: str, nbytes: int = 64 << 20, family: str | None = None) -> str:
    """'N% of the limit at SIZE (a-b); run by run M% (c-d)': the jobs' best time over their
    best limit (median over the jobs, with its range), then each run's time over the limit
    that run measured (every run); of the table's first family, or of ``family`` (the
    in-place limit for a family read in place: bench._limit)."""
    s = _summary(name)
    key = f"all_reduce|{family or s['first']}|{nbytes}"
    v = s["best"]["limit_fraction_by_family"][key]
    r = s["best"]["limit_fraction_same_run_by_family"][key]
    limit = "in-place limit" if family and _best.reads_in_place(family) else "limit"
    job = f"{v[0]:.0%} of this machine's {limit} at {_size(nbytes)} ({v[1]:.0%}{DASH}{v[2]:.0%})"
    runs = f"{r[0]:.0%} ({r[1]:.0%}{DASH}{r[2]:.0%})"
    return f"{job}; run by run, against the {limit} each run measured, {runs}"


def over_floor(name: str, nbytes: int = 1024) -> str:
    """'torch's dispatch floor + X us at SIZE (a-b)': what pycomm's dist.all_reduce adds to
    torch's own cost, in the same runs."""
    v = _summary(name)["best"]["over_floor_us"][f"all_reduce|{nbytes}"]
    return (f"torch's dispatch floor + {v[0]:.1f} µs at {_size(nbytes)} "
            f"({v[1]:.1f}{DASH}{v[2]:.1f})")


def step_ratio(names: tuple[str, ...] = ("step_time-1thread", "step_time-default")) -> str:
    """'a-b x gloo's step time (N model-layout pairs, 1 and default threads)': pycomm's
    training step over gloo's, per (model, layout, threads), from bench.step_time's
    committed results."""
    rows = [r for name in names
            for r in json.loads((STEP_TIMES / f"{name}.json").read_text())["rows"]
            if r.get("pycomm_over_gloo")]
    ratios = [r["pycomm_over_gloo"] for r in rows]
    cells = {(r["model"], r["layout"]) for r in rows}
    threads = " and ".join(sorted({str(r["threads"]) for r in rows}))
    return (f"{min(ratios):.2f}{DASH}{max(ratios):.2f}{TIMES} gloo's step time "
            f"({len(cells)} model-layout pairs, {threads} threads)")


def arena_exposed(name: str = "step_time-1thread") -> str:
    """'DDP's exposed communication per step from A to B ms (GPT), C to D ms (Llama)':
    torch DDP on pycomm without and with pycomm.use_arena, from bench.step_time."""
    rows = json.loads((STEP_TIMES / f"{name}.json").read_text())["rows"]
    exposed = {(r["model"], r["layout"]): r["exposed_ms"] for r in rows
               if r["backend"] == "pycomm" and r["exposed_ms"] is not None}
    parts = [f"{exposed[(m, 'ddp')]:.1f} to {exposed[(m, 'ddp-arena')]:.1f} ms ({label})"
             for m, label in (("gpt", "GPT"), ("llama", "Llama"))]
    return f"DDP's exposed communication per step from {', and from '.join(parts)}"


def loaded_summaries() -> list[str]:
    """The committed loaded summaries' names (not their jobs' raw files)."""
    return sorted(p.stem for p in RESULTS.glob("loaded-*.json") if ".job" not in p.name)


def loaded_worst(fam: str = "pycomm-api") -> str:
    """'at most R x the best peer's time with 1, 2 or 4 competing processes per CPU (cpu, mem;
    worst at SIZE, LOAD)': the largest median ratio over the loaded summaries and sizes."""
    worst, where = 0.0, ""
    loads, kinds = set(), set()
    for name in loaded_summaries():
        s = _summary(name)
        loads.add(s["load"]["per_cpu"])
        kinds.add(s["load"]["kind"])
        for n, v in _per_size(s, "vs_best_peer", fam).items():
            if v[0] > worst:
                worst, where = v[0], f"{_size(n)}, {s['load']['kind']} x{s['load']['per_cpu']}"
    counts = [str(k) for k in sorted(loads)]
    ks = " or ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 2 else counts)
    return (f"at most {worst:.2f}{TIMES} the best peer's time with {ks} competing processes "
            f"per CPU ({', '.join(sorted(kinds))}; worst at {where})")


def made(name: str) -> str:
    """'DATE, CPU (N CPUs), commit C': where and from what code a summary's first job ran."""
    prov = _summary(name)["meta"]["provenance"]
    return f"{prov['started'][:10]}, {machine(prov)}, commit {prov['commit']}"


QUOTES: dict[str, Callable[[], str]] = {
    "headline run": lambda: made("mpirun-2r-fp32-barrier"),
    "gloo speedup, 2 ranks": lambda: speedup_over("mpirun-2r-fp32-barrier", "gloo"),
    "pycomm-api ahead, 2 ranks": lambda: ahead_from("mpirun-2r-fp32-barrier", "pycomm-api"),
    "pycomm-api below, 2 ranks": lambda: behind_below("mpirun-2r-fp32-barrier", "pycomm-api"),
    "pycomm-api ahead, 4 ranks": lambda: ahead_from("mpirun-4r-fp32-barrier", "pycomm-api"),
    "limit, 2 ranks": lambda: limit_fraction("mpirun-2r-fp32-barrier"),
    "limit registered, 2 ranks": lambda: limit_fraction("mpirun-2r-fp32-barrier",
                                                        family="pycomm-registered"),
    "limit registered b2b, 2 ranks": lambda: limit_fraction("mpirun-2r-fp32-b2b",
                                                            family="pycomm-registered"),
    "loaded": loaded_worst,
    "over the floor": lambda: over_floor("small-2r-fp32"),
    "training step": step_ratio,
    "arena ddp": arena_exposed,
}


def all_quotes() -> dict[str, str]:
    return {name: make() for name, make in QUOTES.items()}


README = ROOT / "README.md"


def marked(name: str, text: str) -> str:
    """The README's spelling of one quote: the phrase between its markers."""
    return f"<!-- q:{name} -->{text}<!-- /q -->"


def write_readme(text: str, quotes: dict[str, str]) -> str:
    """``text`` with every marked quote's phrase replaced; a quote whose marker is missing
    is an error (the README must say where each figure goes)."""
    for name, phrase in quotes.items():
        pattern = re.compile(re.escape(f"<!-- q:{name} -->") + r".*?" + re.escape("<!-- /q -->"),
                             re.S)
        found = pattern.search(text)
        if found is None:
            raise SystemExit(f"README has no marker for the quote {name!r}: {marked(name, '...')}")
        # str.replace on the match, not re.sub: a phrase is text, never a template
        text = text.replace(found.group(0), marked(name, phrase))
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quotes", description=__doc__.split("\n")[0])
    p.add_argument("--write-readme", action="store_true", help=f"rewrite the phrases in {README}")
    args = p.parse_args(argv)
    quotes = all_quotes()
    for name, text in quotes.items():
        print(f"{name}: {text}")
    print(f"# from {RESULTS.relative_to(ROOT)} and {STEP_TIMES.relative_to(ROOT)}: medians "
          "over each summary's jobs")
    if args.write_readme:
        README.write_text(write_readme(README.read_text(), quotes))


if __name__ == "__main__":
    main()
