"""Count what one float32 all_reduce costs each rank: ring (ordinary tensor) vs zero-copy (arena).

Why this exists: arena tensors were meant to reach 1.5x the busbw of ordinary ones from
4 MB, and reached 1.08-1.38x (bench/README.md at the time). The suspicion is that both
paths move about the same bytes to and from DRAM (the ring's slots stay in cache), so the zero-copy
path saves only instructions and cache-level copies. This VM has no hardware counters,
so every rank runs under valgrind's cachegrind, which counts instructions (Ir), data
references, D1 misses and last-level (LL) misses; LL misses x 64 B is the implied
traffic past the LL. To leave out torch's import and the group's setup, each case runs
twice, with ``warmup`` and with ``warmup + iters`` all_reduces, and the difference is
divided by ``iters``. Figures are per rank (the mean over ranks) and per op; what torch's
store and malloc do meanwhile varies by up to ~0.2 M Ir per op between runs.

Which LL to simulate (``--ll size,assoc,line``): 1048576,16,64 is one core's L2 here, so
its misses are the bytes that leave the core. 33554432,16,64 is the VM's L3, which the
ranks share: its misses are DRAM fills while the ranks' buffers fit in it together, and
L3 / nproc per rank is the pessimistic share. Left out, valgrind takes the host's L3
from CPUID (384 MiB, simulated as 512 MiB), and nothing misses after warm-up.

Caveats: cachegrind simulates one private cache hierarchy per process, without
coherence: lines a peer has just written count as hits if this rank touched them
recently, and as LL misses otherwise, even when they would come from a shared L3. It
counts line fills only (no write-backs), and an instruction once however wide it is
(under valgrind the kernels run their AVX2 clones, not AVX-512).

Usage::

    python -m records.investigations.profile_cachegrind --nproc 2 --sizes 4M,16M,64M \
        [--ll 1048576,16,64]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from bench._ports import hosted_store, init_default_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo
PATHS = ("ring", "arena")
# Columns of the table: (title, cachegrind events summed).
COLUMNS = (
    ("Ir/op", ("Ir",)),
    ("D refs/op", ("Dr", "Dw")),
    ("D1 misses/op", ("D1mr", "D1mw")),
    ("LL misses/op", ("DLmr", "DLmw")),
)
ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",  # the same dict layouts in both runs of a case
    "PYCOMM_SPIN_US": "0",  # a waiting rank sleeps on a futex instead of counting polls
    "PYCOMM_YIELD_US": "0",
    "PYCOMM_TIMEOUT_S": "3600",  # ranks run ~50x slower under valgrind
    # glibc's memcpy uses `rep movsb` from 2 KiB, which valgrind counts as one instruction
    # and one load and store per byte; this makes it use its vector loop instead.
    "GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=0x7fffffffffffffff",
}


def parse_size(text: str) -> int:
    """'4M' -> 4194304 bytes (K, M and G are powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def rank_main(nbytes: int, path: str, ops: int) -> None:
    """One rank (under valgrind): set up, then run ``ops`` all_reduces in place."""
    gc.disable()  # a collection that only the longer run reaches would count as its ops'
    import torch
    import torch.distributed as dist

    import pycomm

    # rank and world from the environment, the launcher's store (bench._ports)
    init_default_group("pycomm", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    alloc = pycomm.empty if path == "arena" else torch.empty
    tensor = alloc(nbytes // 4, dtype=torch.float32).fill_(1.0)
    for _ in range(ops):
        backend.all_reduce_now(tensor, "sum")  # as bench's pycomm-native
    expect = float(dist.get_world_size() ** ops)
    if pycomm.in_arena(tensor) != (path == "arena") or tensor[-1].item() != expect:
        raise SystemExit(f"rank {dist.get_rank()}: wrong path or result")
    dist.destroy_process_group()


def launch(nproc: int, nbytes: int, path: str, ops: int, args, prefix: str) -> list[str]:
    """Run every rank under cachegrind; return their output files. Raises on failure."""
    procs, outs = [], []
    tool = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--trace-children=no"]
    tool += [f"--LL={args.ll}"] if args.ll else []
    child = [sys.executable, "-m", "records.investigations.profile_cachegrind", "--rank",
             str(nbytes), path]
    # The ranks join a store held here on a port bound once (bench._ports).
    with hosted_store(nproc):
        try:
            for rank in range(nproc):
                outs.append(f"{prefix}.{rank}.out")
                env = dict(os.environ, **ENV, RANK=str(rank), WORLD_SIZE=str(nproc))
                cmd = [*tool, f"--cachegrind-out-file={outs[-1]}", *child, str(ops)]
                log = open(f"{prefix}.{rank}.log", "w")  # noqa: SIM115 (the child has its own)
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=ROOT))
                log.close()
            end = time.monotonic() + args.timeout
            codes = [p.wait(timeout=max(0, end - time.monotonic())) for p in procs]
        finally:
            stop(procs)
    if any(codes):
        raise RuntimeError(f"{prefix}: ranks exited with {codes}; see {prefix}.*.log")
    return outs


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the ranks still running, and remove the shared memory any of them left."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for name in glob.glob(f"/dev/shm/pycomm-{proc.pid}-*"):
            os.unlink(name)


def read_profile(path: str) -> tuple[dict[str, int], dict[str, dict[str, int]], str]:
    """A cachegrind output file's totals, per-function counts and LL description."""
    events: list[str] = []
    totals: dict[str, int] = {}
    funcs: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    fn, ll = "", ""
    with open(path) as f:
        for line in f:
            if line.startswith("desc: LL cache:"):
                ll = " ".join(line.split()[3:])
            elif line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif line.startswith("summary:"):
                totals = dict(zip(events, map(int, line.split()[1:]), strict=True))
            elif line[:1].isdigit():
                for event, count in zip(events, map(int, line.split()[1:]), strict=False):
                    funcs[fn][event] += count
    return totals, funcs, ll


def diff(full: dict, base: dict, iters: int) -> dict[str, float]:
    return {e: (full[e] - base.get(e, 0)) / iters for e in full}


def per_op(base: str, full: str, iters: int) -> tuple[dict, dict, str]:
    """(totals, per-function counts, LL) of one op: the runs' difference over ``iters``."""
    (base_tot, base_fn, _), (full_tot, full_fn, ll) = read_profile(base), read_profile(full)
    funcs = {fn: diff(c, base_fn.get(fn, {}), iters) for fn, c in full_fn.items()}
    return diff(full_tot, base_tot, iters), funcs, ll


def profile_case(nproc: int, nbytes: int, path: str, args) -> tuple[dict, dict, str]:
    """One op's counts for one size and path: mean over ranks, rank 0's functions, LL."""
    prefix = os.path.join(args.out_dir, f"{path}-{nbytes}-{nproc}r")
    base = launch(nproc, nbytes, path, args.warmup, args, prefix + "-base")
    full = launch(nproc, nbytes, path, args.warmup + args.iters, args, prefix + "-full")
    ranks = [per_op(b, f, args.iters) for b, f in zip(base, full, strict=True)]
    mean = {e: sum(r[0][e] for r in ranks) / nproc for e in ranks[0][0]}
    return mean, ranks[0][1], ranks[0][2]


def row(size: str, path: str, cells: list[float]) -> str:
    """A table row: counts as integers, the LL-miss MiB with two decimals."""
    text = [f"{c:,.0f}" for c in cells[:-1]] + [f"{cells[-1]:.2f}"]
    return f"| {size} | {path} | " + " | ".join(text) + " |"


def cells(counts: dict[str, float]) -> list[float]:
    """The table's columns for one case, ending with LL misses x 64 B in MiB."""
    values = [sum(counts[e] for e in events) for _, events in COLUMNS]
    return [*values, values[-1] * 64 / (1 << 20)]


def report(results: dict, nproc: int, ll: str | None) -> None:
    """Print the markdown table: per size, ring, arena, and their ratio."""
    simulated = next(iter(results.values()))["ring"][2]  # cachegrind's own description
    print(f"\n{nproc} ranks, --LL={ll or 'auto-detected'} (simulated LL: {simulated});")
    print("per rank (mean over ranks), per op\n")
    titles = [t for t, _ in COLUMNS] + ["LL-miss MiB/op (x64 B)"]
    print("| size | path | " + " | ".join(titles) + " |")
    print("|---|---|" + "---|" * len(titles))
    for size, by_path in results.items():
        ring, arena = cells(by_path["ring"][0]), cells(by_path["arena"][0])
        print(row(size, "ring", ring))
        print(row(size, "arena", arena))
        ratios = [r / a if a else float("inf") for r, a in zip(ring, arena, strict=True)]
        print(f"| {size} | ring/arena | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")


def report_top(results: dict, top: int) -> None:
    """Print rank 0's ``top`` functions by Ir per op, for every case."""
    for size, by_path in results.items():
        for path, (_, funcs, _) in by_path.items():
            print(f"\ntop functions by Ir/op, {size} {path} (rank 0): Ir, D1 misses, LL misses")
            for fn, c in sorted(funcs.items(), key=lambda kv: -kv[1]["Ir"])[:top]:
                misses = [sum(c.get(e, 0) for e in events) for _, events in COLUMNS[2:]]
                print(f"  {c['Ir']:>13,.0f} {misses[0]:>11,.0f} {misses[1]:>11,.0f}  {fn[:90]}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--sizes", default="4M,16M,64M", help="message sizes (default 4M,16M,64M)")
    p.add_argument("--ll", help="cachegrind --LL=size,assoc,line (default: auto-detected)")
    p.add_argument("--warmup", type=int, default=3, help="all_reduces before counting")
    p.add_argument("--iters", type=int, default=5, help="all_reduces counted")
    p.add_argument("--top", type=int, default=0, help="also list the top N functions by Ir")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per valgrind run")
    p.add_argument("--out-dir", help="keep cachegrind files here (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:  # a rank under valgrind: --rank NBYTES PATH OPS
        return rank_main(int(argv[1]), argv[2], int(argv[3]))
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `launch` stops the ranks
    with tempfile.TemporaryDirectory(prefix="pycomm-cg-") as tmp:
        args.out_dir = args.out_dir or tmp
        os.makedirs(args.out_dir, exist_ok=True)
        results: dict = {}
        for size in args.sizes.split(","):
            for path in PATHS:
                print(f"profiling {size} {path} ...", file=sys.stderr, flush=True)
                case = profile_case(args.nproc, parse_size(size), path, args)
                results.setdefault(size, {})[path] = case
        report(results, args.nproc, args.ll)
        if args.top:
            report_top(results, args.top)


if __name__ == "__main__":
    main()
