"""Command line of the collective benchmark: nccl-tests' flags plus backends and ops."""

import argparse
import os
from pathlib import Path

import torch

from bench import _mpi, _stripes
from bench._timing import OPS, REDOPS

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1K', '64M', '1G' (powers of 1024, as nccl-tests) or plain bytes."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*f, lo*f^2, ... up to and including hi."""
    if lo <= 0 or factor < 2 or hi < lo:
        raise SystemExit(f"bad size sweep: -b {lo} -e {hi} -f {factor} (need 0 < b <= e, f >= 2)")
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def _labels(backends: list[str]) -> list[str]:
    """Unique labels: a repeated backend becomes 'gloo#2' (an A/A run shows the noise)."""
    out: list[str] = []
    for b in backends:
        out.append(b if b not in out else f"{b}#{sum(o.split('#')[0] == b for o in out) + 1}")
    return out


def _backends(args: argparse.Namespace, notes: list[str]) -> list[str]:
    """--backends resolved: the default depends on Open MPI being installed."""
    if args.backends is None:
        why = _mpi.missing()
        args.backends = "pycomm,gloo" if why else "pycomm,gloo,mpi"
        if why:
            notes.append(f"mpi left out of the default backends: {why}")
    out = [b for b in args.backends.split(",") if b]
    if args.registered and "pycomm-registered" not in out:
        at = out.index("pycomm") + 1 if "pycomm" in out else 0
        out.insert(at, "pycomm-registered")
    return out


def _with_gloo_variants(backends: list[str]) -> list[str]:
    """--tuned: gloo's variants (bench._gloo.VARIANTS) right after gloo, once."""
    from bench._gloo import VARIANTS

    if "gloo" not in backends:
        return backends
    at = backends.index("gloo") + 1
    extra = [v for v in VARIANTS if v not in backends]
    return backends[:at] + extra + backends[at:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags as nccl-tests: -b -e -f -n -w -c -d, plus the backends and ops to compare."""
    p = argparse.ArgumentParser(
        prog="python -m bench.collectives",
        description="Time collectives of several backends side by side, nccl-tests style.",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma list of pycomm, pycomm-registered, gloo, mpi (or any torch backend); "
        "one column each, interleaved per size in one job, with a ratio column "
        "first/other for every other backend. pycomm-registered is pycomm timed on "
        "buffers from pycomm.empty (zero-copy tensors in its shared-memory arena); "
        "pycomm-native is pycomm's own blocking all_reduce_now, bypassing torch's "
        "dispatcher (all_reduce only), as mpi4py bypasses nothing of MPI; pycomm-op is "
        "torch.ops.pycomm.all_reduce_, the torch operator (all_reduce only); pycomm-api is "
        "pycomm.all_reduce_, the function trainers call (eager: the native entry; "
        "compiled: the operator; all_reduce only). "
        "torch-floor is dist.all_reduce on torch's FakeProcessGroup (no communication: "
        "the dispatch floor no backend reached through dist.all_reduce can beat, timed "
        "like the others; all_reduce only, never checked). "
        "deepspeed is DeepSpeed's CPU shared-memory all-reduce "
        "(torch.ops.deepspeed.inference_all_reduce_; deepspeed-api: "
        "deepspeed.comm.inference_all_reduce), SUM of float32/bfloat16/float16 only. "
        "mpi is Open MPI through mpi4py: unless already under mpirun, the benchmark "
        "re-executes itself under 'mpirun --allow-run-as-root --oversubscribe -np NPROC' "
        "so that every backend shares the same ranks. "
        "Default: pycomm,gloo,mpi when mpi4py and mpirun are installed, else pycomm,gloo",
    )
    p.add_argument(
        "--registered",
        action="store_true",
        help="add pycomm-registered right after pycomm in --backends (both side by side, "
        "ratio pycomm/pycomm-registered); fails when pycomm.empty does not exist",
    )
    p.add_argument(
        "--mpirun-args",
        default="--bind-to none",
        help="extra mpirun flags for the re-execution (default '--bind-to none': ranks "
        "float as spawned ranks do, so pycomm and gloo run as they would without mpi)",
    )
    p.add_argument(
        "--bind",
        choices=["auto", "core", "none"],
        default="auto",
        help="pin each local rank to one CPU (rank modulo the CPUs this process may use), "
        "for every backend alike. auto (default): pin when ranks <= CPUs, as mpirun binds to "
        "cores by default; float when oversubscribed",
    )
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {','.join(OPS)}")
    p.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="local ranks to start (mpirun's -np with mpi); ignored under torchrun/mpirun",
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"), help="1K")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (4)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations (5)")
    p.add_argument("-c", "--check", type=int, default=1, help="count wrong elements (0: off)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "-o",
        "--op",
        dest="redop",
        default="sum",
        choices=sorted(REDOPS),
        help="reduction op for all_reduce and reduce_scatter",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench/out/collectives.json"),
        help="JSON path; the PNG goes beside it",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--require-all",
        action="store_true",
        help="stop before measuring when a named backend cannot run here (not installed, "
        "cannot start) instead of skipping it: a comparison that must hold every peer",
    )
    p.add_argument(
        "--timing",
        choices=["barrier", "b2b"],
        default="barrier",
        help="barrier (default): a barrier before every timed call, the median of the "
        "slowest rank; b2b: the calls back to back after one barrier, as nccl-tests times",
    )
    p.add_argument(
        "--aa",
        action="store_true",
        help="add the first backend once more at the end (an A/A column: its ratio to the "
        "first is the noise floor of this job)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run K fresh jobs (new processes, new groups) and report each cell as the "
        "median of the K with its range; every job's JSON is kept beside --out",
    )
    p.add_argument(
        "--mpi-tuned",
        action="store_true",
        help="time Open MPI in both shared-memory configurations, each job once as "
        "launched and once more with its single-copy mechanism off (CMA off: "
        "--mca btl_vader_single_copy_mechanism none); the report shows the best per size "
        "and which won",
    )
    p.add_argument(
        "--tuned",
        action="store_true",
        help="every peer at its best: each job runs pinned (--bind core) and unpinned "
        "(--bind none), Open MPI with and without single copy (as --mpi-tuned), gloo with "
        "its variants (bench._gloo: worker threads, devices, interface) beside torch's "
        "default; each backend's best per size counts, named with what won (bench._best)",
    )
    p.add_argument(
        "--load",
        type=int,
        default=0,
        help="K competing processes per CPU for the whole job, each pinned to its CPU "
        "(--load-kind: cpu, a busy loop; mem, streaming copies of 64 MiB): a rank shares "
        "its core as it does beside compute threads and other jobs (bench._load)",
    )
    p.add_argument("--load-kind", choices=["cpu", "mem"], default="cpu",
                   help="what the --load processes do (cpu)")
    p.add_argument(
        "--local-size",
        type=int,
        default=None,
        help="simulate hosts: every N consecutive ranks form one island (sets "
        "PYCOMM_LOCAL_SIZE for the ranks); pycomm then runs shared memory inside an island "
        "and gloo between islands",
    )
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    args.notes = []
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.local_size is not None:
        if args.local_size <= 0:
            p.error(f"--local-size must be positive, got {args.local_size}")
        os.environ["PYCOMM_LOCAL_SIZE"] = str(args.local_size)  # inherited by the ranks
        args.notes.append(f"pycomm on simulated islands of {args.local_size} ranks "
                          "(PYCOMM_LOCAL_SIZE): shared memory inside, gloo between")
    if args.load < 0:
        p.error(f"--load must be 0 or more, got {args.load}")
    chosen = _backends(args, args.notes)
    if args.tuned:
        chosen = _stripes.with_striped_twins(_with_gloo_variants(chosen))
        args.mpi_tuned = args.mpi_tuned or "mpi" in chosen
    if args.aa and chosen:
        chosen.append(chosen[0])
    args.backends = _labels(chosen)
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; choose from {list(OPS)}")
    args.sizes = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    return args
