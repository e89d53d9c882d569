"""Command line of the collective benchmark: nccl-tests' flags plus backends and ops."""

import argparse
from pathlib import Path

import torch

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags as nccl-tests: -b -e -f -n -w -c -d, plus the backends and ops to compare."""
    p = argparse.ArgumentParser(
        prog="pycomm-bench",
        description="Time collectives of several backends side by side, nccl-tests style.",
    )
    p.add_argument(
        "--backends",
        default="pycomm,gloo",
        help="comma list; ratios are first/second (default: pycomm,gloo)",
    )
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {','.join(OPS)}")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (not torchrun)")
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
        default=Path("bench/results/collectives.json"),
        help="JSON path; the PNG goes beside it",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.backends = _labels([b for b in args.backends.split(",") if b])
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; choose from {list(OPS)}")
    args.sizes = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    return args
