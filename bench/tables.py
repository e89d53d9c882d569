"""Markdown tables of a ``--jobs`` summary, every backend at its best (bench._best).

    python -m bench.tables records/collectives/mpirun-2r-fp32-barrier.json [...]

One table per summary and op: each family's best time (median [min-max] over the jobs,
and which setting won most often), every pycomm entry's ratio to the best peer (below 1:
pycomm faster), the A/A ratio (the job's noise floor), the limit busbw and pycomm's
fraction of it (bench._limit): the job's best time over its best limit, and each run's
time over the limit that run measured (every run, so the machine's state is paired with
the time it gave). The README's figures and bench/README.md's tables come
from here, from committed summaries only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import _best

SHORT = {"@unpinned": " unpinned"}

DASH, TIMES = "\u2013", "\u00d7"  # the README's typography


def _num(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _cell(v: list[float] | None) -> str:
    return "-" if v is None else f"{_num(v[0])} ({_num(v[1])}{DASH}{_num(v[2])})"


def _winner(counts: dict[str, int] | None) -> str:
    if not counts:
        return ""
    label = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    for k, v in SHORT.items():
        label = label.replace(k, v)
    return label


def families(s: dict, op: str) -> list[str]:
    """The families measured for ``op``, pycomm first, then the peers, A/A last."""
    seen = {k.split("|")[1] for k in s["best"]["best_us"] if k.startswith(op + "|")}
    mine = [f for f in seen if not _best.is_peer(f) and "#" not in f]
    mine.sort(key=lambda f: (f != s["first"], f))
    peers = [p for p in _best.PEERS if p in seen]
    return mine + peers


def sizes(s: dict, op: str) -> list[int]:
    return sorted({int(k.split("|")[2]) for k in s["best"]["best_us"] if k.startswith(op + "|")})


def table(s: dict, op: str) -> list[str]:
    """One markdown table for ``op`` of summary ``s``."""
    b, fams = s["best"], families(s, op)
    mine = [f for f in fams if not _best.is_peer(f)]
    floor = bool(b.get("over_floor_us"))
    others = _other_limit_families(b, op, mine, s["first"])
    in_place = any(k.startswith(op + "|") for k in b.get("limit_busbw_in_place", {}))
    head = ([f"{f} µs" for f in fams] + ["best peer (won)"]
            + [f"{f} / best peer" for f in mine] + ["A/A", "limit busbw GB/s"]
            + (["in-place limit busbw GB/s"] if in_place else [])
            + [f"{s['first']} / limit", f"{s['first']} / limit, same run"]
            + [f"{f} / {'in-place ' if _best.reads_in_place(f) else ''}limit" for f in others]
            + ([f"{s['first']} - torch floor µs"] if floor else []))
    lines = ["| size | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for n in sizes(s, op):
        cells = []
        for f in fams:
            key = f"{op}|{f}|{n}"
            won = _winner(b["best_won_by"].get(key)) if _best.is_peer(f) else ""
            cells.append(_cell(b["best_us"].get(key)) + (f" {won}" if won else ""))
        cells.append(_winner(b["best_peer_won_by"].get(f"{op}|{n}")))
        cells += [_cell(b["vs_best_peer"].get(f"{op}|{f}|{n}")) for f in mine]
        cells.append(_cell(b["aa"].get(f"{op}|{n}")))
        lim = b["limit_busbw"].get(f"{op}|{n}")
        cells.append(_num(lim[0]) if lim else "-")
        if in_place:
            lim = b["limit_busbw_in_place"].get(f"{op}|{n}")
            cells.append(_num(lim[0]) if lim else "-")
        cells.append(_cell(b["limit_fraction"].get(f"{op}|{n}")))
        cells.append(_cell(b.get("limit_fraction_same_run", {}).get(f"{op}|{n}")))
        cells += [_cell(b["limit_fraction_by_family"].get(f"{op}|{f}|{n}")) for f in others]
        if floor:
            cells.append(_cell(b["over_floor_us"].get(f"{op}|{n}")))
        lines.append(f"| {size_label(n)} | " + " | ".join(cells) + " |")
    return lines


def _other_limit_families(b: dict, op: str, mine: list[str], first: str) -> list[str]:
    """pycomm's families besides the first with a fraction of the limit for ``op`` (the
    arena's ``pycomm-registered``, ``pycomm-api``): a column each."""
    have = {k.split("|")[1] for k in b.get("limit_fraction_by_family", {})
            if k.startswith(op + "|")}
    return [f for f in mine if f != first and f in have]


def size_label(n: int) -> str:
    """1024 -> '1 KB', 65536 -> '64 KB', 16 -> '16 B'."""
    for unit, shift in (("MB", 20), ("KB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def describe(s: dict) -> str:
    """The line above a table: what ran, how it was timed, the machine's state."""
    meta = s["meta"]
    c2c = [r for pair in s["c2c"] for r in pair if r]
    rt = [r["round_trip_ns"] for r in c2c]
    both = [r["exchange_gbs"] for r in c2c if r.get("exchange_gbs")]
    exchange = (f", {min(both):.0f}{DASH}{max(both):.0f} GB/s each way both at once"
                if both else "")
    states = sorted({r["state"] for r in c2c})
    load = s.get("load") or {}
    loaded = (f"load {load['per_cpu']} {load['kind']} process(es) per CPU"
              if load.get("per_cpu") else "no added load")
    prov = meta.get("provenance") or {}
    return (f"{meta['nproc']} ranks, {meta['datatype']}, timing {meta.get('timing', 'barrier')}, "
            f"{s['jobs']} fresh jobs, {loaded}; {machine(prov)}; "
            f"commit {prov.get('commit', '?')}; c2c round "
            f"trip {min(rt, default=0):.0f}{DASH}{max(rt, default=0):.0f} ns "
            f"({', '.join(states)}){exchange}; "
            f"load average {_loadavg(prov)}; #wrong {s['wrong']}")


def machine(prov: dict) -> str:
    """'CPU model (N CPUs)': the tables of one section may come from different VMs."""
    return f"{prov.get('cpu', '?')} ({len(prov.get('cpus') or []) or '?'} CPUs)"


def _loadavg(prov: dict) -> str:
    la = prov.get("loadavg")
    return "?" if la is None else (" ".join(f"{v:.2f}" for v in la) if isinstance(la, list)
                                   else str(la))


def is_summary(path: Path) -> bool:
    """Whether ``path`` is a ``--jobs`` summary (what the tables are made from)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "best" in data


def render(path: Path) -> list[str]:
    return render_summary(json.loads(Path(path).read_text()), Path(path).stem)


def render_summary(s: dict, name: str) -> list[str]:
    """A summary's heading, its description line and one table per op."""
    ops = sorted({k.split("|")[0] for k in s["best"]["best_us"]})
    out = [f"#### {name}", "", describe(s), ""]
    for op in ops:
        if len(ops) > 1:
            out += [f"{op}:", ""]
        out += table(s, op) + [""]
    return out


README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- collective tables: begin -->", "<!-- collective tables: end -->"


def replace_in_readme(text: str, sections: dict[str, list[str]]) -> str:
    """``text`` with each named ``#### NAME`` section between the collective-table markers
    replaced by its new lines (a name not there yet is added at the end, before the end
    marker)."""
    head, rest = text.split(BEGIN + "\n", 1)
    block, tail = rest.split(END, 1)
    order: list[str] = []
    found: dict[str, list[str]] = {}
    for chunk in block.split("#### ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        order.append(name)
        found[name] = ("#### " + chunk).rstrip("\n").split("\n") + [""]
    for name, lines in sections.items():
        if name not in found:
            order.append(name)
        found[name] = lines
    body = [line for name in order for line in found[name]]
    return head + BEGIN + "\n\n" + "\n".join(body) + "\n" + END + tail


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tables", description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", type=Path)
    p.add_argument("--rebuild", action="store_true",
                   help="first make each summary again from the raw files it lists")
    p.add_argument("--write-readme", action="store_true",
                   help="replace each summary's section between the collective-table "
                        f"markers of {README}")
    args = p.parse_args(argv)
    sections = {}
    for path in args.summaries:
        if not is_summary(path):  # a glob over a results folder meets each job's file too
            print(f"bench.tables: skipped {path}: not a --jobs summary (no 'best'; a job's "
                  "own results are summarized by the summary that lists it)", file=sys.stderr)
            continue
        if args.rebuild:
            from bench._summary import resummarize

            resummarize(path)
        sections[path.stem] = render(path)
        print("\n".join(sections[path.stem]))
    if args.write_readme:
        README.write_text(replace_in_readme(README.read_text(), sections))


if __name__ == "__main__":
    main()
