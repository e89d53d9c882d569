"""Expert parallelism's dispatch and combine: pycomm's op against all_to_all peers.

Every case is a rank's tokens routed top-k over E experts (E / world per rank), moved
by each peer of :mod:`bench._dispatch_peers` in one job, the peers interleaved per case
with the order alternating; each time is the slowest rank's, the median over
iterations. Reported per case and peer: dispatch and combine times, GB/s of the rows
each rank sends (every (token, choice) row, its own included, as DeepEP counts them),
the fraction of this machine's limit for an all_to_all of those bytes measured in the
same job (:mod:`bench._limit`: the tensor's bytes at the local copy rate, the exchanged
bytes at the core-to-core handoff rate), and the ratio to pycomm. ``--jobs N`` runs N
fresh jobs and writes their medians and ranges, with the A/A column (``pycomm#2``:
pycomm again on its own group).

    python -m bench.dispatch --nproc 2 --jobs 3 --out records/moe/dispatch-2r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import _c2c, _dispatch_peers, _limit, _ports, _provenance
from bench._jobs import _strip
from bench._launch import launch

PEERS = "pycomm,pycomm#2,pycomm-a2a,gloo,mpi"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1, help="fresh jobs (medians and ranges)")
    p.add_argument("--backends", default=PEERS, help="the peers, comma-separated")
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--hidden", default="1024,4096")
    p.add_argument("--routing", default="2/8,8/64", help="top-k/experts pairs")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-mib", type=float, default=256,
                   help="skip cases whose rows per rank exceed this (MiB)")
    # Open MPI pins each rank to a core by default: the c2c reading needs two
    p.add_argument("--mpirun-args", default="--bind-to none")
    p.add_argument("--out", type=Path, default=Path("bench/out/dispatch.json"))
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    return args


def cases(args: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    """(tokens, hidden, top-k, experts) within --max-mib."""
    size = DTYPES[args.dtype].itemsize
    out = []
    for t in (int(v) for v in args.tokens.split(",")):
        for h in (int(v) for v in args.hidden.split(",")):
            for pair in args.routing.split(","):
                k, e = (int(v) for v in pair.split("/"))
                if t * k * h * size <= args.max_mib * 2**20:
                    out.append((t, h, k, e))
    return out


def routed(case: tuple[int, int, int, int], dtype: torch.dtype, world: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows ordered by expert and their counts (world, E / world)."""
    tokens, hidden, k, experts = case
    gen = torch.Generator().manual_seed(dist.get_rank() * 7919 + tokens + hidden + k)
    choice = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(choice, stable=True)
    states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    counts = torch.bincount(choice, minlength=experts).view(world, experts // world)
    return states[order // k].contiguous(), counts


def time_peer(peer, rows: torch.Tensor, counts: torch.Tensor, iters: int, warmup: int
              ) -> tuple[list[tuple[float, float]], bool, list[int]]:
    """(dispatch s, combine s) per iteration; whether every row came back; the counts
    received (each peer must learn the same)."""
    times, right, got_counts = [], True, []
    for i in range(warmup + iters):
        peer.barrier()  # the peer's own: its ranks leave it together
        start = time.perf_counter()
        arrived, received = peer.dispatch(rows, counts)
        mid = time.perf_counter()
        back = peer.combine(arrived, counts, received)
        end = time.perf_counter()
        if i == 0:
            right = bool(torch.equal(back, rows))
            got_counts = received.reshape(-1).tolist()
        if i >= warmup:
            times.append((mid - start, end - mid))
        del arrived, back
    return times, right, got_counts


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    _ports.init_default_group("gloo", rank, world)
    import pycomm  # noqa: F401  (registers the backend)

    reasons: list = [None] * world
    dist.all_gather_object(reasons, [_dispatch_peers.missing(b) for b in args.backends])
    skipped = {b: next(r[i] for r in reasons if r[i]) for i, b in enumerate(args.backends)
               if any(r[i] for r in reasons)}
    peers = {b: _dispatch_peers.make(b) for b in args.backends if b not in skipped}
    info = _provenance.collect([], sys.argv) if rank == 0 else {}
    info["c2c_before"] = _c2c.reading() if rank == 0 else None
    results = []
    for n, case in enumerate(cases(args)):
        rows, counts = routed(case, DTYPES[args.dtype], world)
        order = list(peers) if n % 2 == 0 else list(peers)[::-1]
        for name in order:
            times, right, got = time_peer(peers[name], rows, counts, args.iters, args.warmup)
            results.append({"case": case, "peer": name, "times": times, "right": right,
                            "counts": got, "bytes": rows.numel() * rows.element_size()})
    info["c2c_after"] = _c2c.reading() if rank == 0 else None
    sizes = sorted({r["bytes"] for r in results})
    passes = _limit.time_locals(sizes, 3, dist.group.WORLD)
    gathered: list = [None] * world if rank == 0 else []
    dist.gather_object((results, passes), gathered if rank == 0 else None, dst=0)
    if rank == 0:
        write_job(args, gathered, info, skipped, world)
    dist.barrier()
    dist.destroy_process_group()


def write_job(args: argparse.Namespace, gathered: list, info: dict, skipped: dict,
              world: int) -> None:
    """Rank 0: the slowest rank per iteration, medians, GB/s and the limit; JSON."""
    local = {n: _limit.local_gbs(n, [g[1][n] for g in gathered]) for n in gathered[0][1]}
    handoff = _limit.best_handoff([info.get("c2c_before"), info.get("c2c_after")])
    per_core = _limit.ranks_per_core(world, os.cpu_count() or 1)
    rows = []
    for i, r in enumerate(gathered[0][0]):
        mine = [g[0][i] for g in gathered]
        slowest = [tuple(max(t[j] for t in it) for j in (0, 1))
                   for it in zip(*(m["times"] for m in mine), strict=True)]
        dispatch = statistics.median(s[0] for s in slowest)
        combine = statistics.median(s[1] for s in slowest)
        nbytes = max(m["bytes"] for m in mine)
        at = next((n for n in sorted(local) if n >= nbytes), max(local))
        limit = _limit.limit_seconds("all_to_all", nbytes, world, local[at],
                                     local[_limit.MIN_TIMED_BYTES], handoff, per_core)
        rows.append({"case": r["case"], "peer": r["peer"], "dispatch_s": dispatch,
                     "combine_s": combine, "bytes": nbytes, "limit_s": limit,
                     "right": all(m["right"] for m in mine),
                     "counts": [m["counts"] for m in mine]})
    reference = {tuple(r["case"]): r["counts"] for r in rows if r["peer"] == "pycomm"}
    for r in rows:  # every peer must deliver the same counts as pycomm
        r["right"] = r["right"] and r.pop("counts") == reference.get(tuple(r["case"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "world": world, "dtype": args.dtype, "iters": args.iters, "skipped": skipped,
        "provenance": {**info, "finished": _provenance.now()},
        "c2c": [_c2c.describe(info.get("c2c_before")), _c2c.describe(info.get("c2c_after"))],
        "load": os.getloadavg(), "rows": rows}, indent=1, default=str))


def summarize(paths: list[Path]) -> str:
    """Markdown: per case and peer, the median over jobs (range) of dispatch and combine
    times, GB/s, fraction of the limit and ratio to pycomm."""
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    key = [(tuple(r["case"]), r["peer"]) for r in first["rows"]]
    by_job = [{(tuple(r["case"]), r["peer"]): r for r in run["rows"]} for run in runs]
    lines = [f"{first['world']} ranks, {first['dtype']}, {len(runs)} fresh jobs (median, "
             "[min-max]); time = the slowest rank's median; GB/s = rows sent per rank / "
             "time; limit = an all_to_all of those bytes at this job's copy and handoff "
             "rates; x pycomm = the peer's time / pycomm's in the same job",
             "c2c: " + "; ".join(" / ".join(r["c2c"]) for r in runs),
             "load: " + "; ".join(" ".join(f"{v:.2f}" for v in r["load"]) for r in runs), "",
             "| tokens x hidden, top-k/E | peer | dispatch ms | combine ms | dispatch GB/s "
             "| of limit | x pycomm (dispatch) | x pycomm (combine) | right |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"

    for case, peer in key:
        rs = [j[(case, peer)] for j in by_job]
        base = [j[(case, "pycomm")] for j in by_job]
        d = [r["dispatch_s"] * 1e3 for r in rs]
        c = [r["combine_s"] * 1e3 for r in rs]
        gbs = [r["bytes"] / r["dispatch_s"] / 1e9 for r in rs]
        frac = [r["limit_s"] / r["dispatch_s"] for r in rs]
        xd = [r["dispatch_s"] / b["dispatch_s"] for r, b in zip(rs, base, strict=True)]
        xc = [r["combine_s"] / b["combine_s"] for r, b in zip(rs, base, strict=True)]
        t, h, k, e = case
        lines.append(f"| {t} x {h}, {k}/{e} | {peer} | {cell(d, '.2f')} | {cell(c, '.2f')} | "
                     f"{cell(gbs, '.2f')} | {cell(frac, '.2f')} | {cell(xd, '.2f')} | "
                     f"{cell(xc, '.2f')} | {all(r['right'] for r in rs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.jobs <= 1:
        launch(argv, args, worker, module="bench.dispatch")
        return
    paths = []
    for job in range(args.jobs):
        path = args.out.with_name(f"{args.out.stem}-job{job + 1}.json")
        rest = _strip(_strip(argv, "--jobs", True), "--out", True)
        cmd = [sys.executable, "-m", "bench.dispatch", *rest, "--jobs", "1", "--out", str(path)]
        subprocess.run(cmd, check=True)
        paths.append(path)
    print(write_summary(paths, args.out))


def write_summary(paths: list[Path], out: Path) -> str:
    """The table of the jobs ``paths`` into ``out`` (.md) and, with the jobs' names,
    ``out`` itself (JSON); returns the table."""
    table = summarize(paths)
    out.with_suffix(".md").write_text(table + "\n")
    out.write_text(json.dumps({"jobs": [p.name for p in paths], "table": table}, indent=1))
    return table


if __name__ == "__main__":
    main()
