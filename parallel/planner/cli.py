"""The planner's command line: its own flags, and every flag of ``pycomm.parallel.train`` for
the model and the batch (read by the trainer's own parser, so they mean the same)."""

from __future__ import annotations

import argparse

from ..job.config import TrainConfig, parse


def build_parser(prog: str = "python -m pycomm.parallel.planner") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Every layout pycomm.parallel.train accepts for --world ranks, "
        "with its predicted per-rank memory and step time; what does not fit in "
        "--memory-gb is marked, the rest ranked by time. Any other flag is the trainer's "
        "(--model, --n-layer, --n-embd, --n-head, --block-size, --batch-size, "
        "--microbatches, --bucket-mb, --threads, ...).")
    parser.add_argument("--world", type=int, default=0,
                        help="ranks (default: the trainer's nproc, else dp * tp * pp)")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="per-rank memory, GiB (default: this machine's over the ranks)")
    parser.add_argument("--calibration", default="",
                        help="JSON of measured compute times (default: "
                        "~/.cache/pycomm/plan_calibration.json)")
    parser.add_argument("--comm-results", default="",
                        help="folder of the collective benchmark's summaries (default: the "
                        "checkout's records/collectives)")
    parser.add_argument("--other-load", type=float, default=0.0,
                        help="runnable processes beside the job, sharing its CPUs (e.g. "
                        "the load average before it starts; default 0: a machine of its own)")
    parser.add_argument("--top", type=int, default=0, help="print only the best N that fit")
    parser.add_argument("--json", default="", help="also write every row to this file")
    return parser


def parse_args(argv: list[str] | None = None,
               parser: argparse.ArgumentParser | None = None
               ) -> tuple[argparse.Namespace, TrainConfig]:
    """The planner's flags, and the trainer's settings from the rest (checked by it)."""
    args, rest = (parser or build_parser()).parse_known_args(argv)
    cfg = parse(rest)
    if not args.world:
        args.world = cfg.nproc or cfg.layout.world
    return args, cfg


def memory_gib(requested: float, world: int) -> float:
    """``requested``, or this machine's memory shared by ``world`` ranks."""
    if requested > 0:
        return requested
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / world / (1 << 30)
