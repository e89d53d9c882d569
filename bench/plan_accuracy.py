"""The planner against measurements: ``python -m bench.plan_accuracy --model gpt
[trainer model flags] --world 4 --out records/planner/NAME``.

Every layout ``python -m pycomm.parallel.planner`` lists for the model and world (offload none: the
trainer's in-memory layouts) is built by the trainer's own code on one pool of ranks
and measured (bench._plan_accuracy_rank: peak bytes in use per rank over a step, what
the engine holds by role, the rise of peak RSS, the median step time); ``NAME.jsonl``
keeps the raw measurements, one line per layout. ``--report`` then compares them with
the planner's predictions (per rank: memory; per layout: step time) and writes
``NAME.md``: the error table, the largest errors, and the layout ``--plan auto`` picks
against the fastest one measured.

Example::

    python -m bench.plan_accuracy --world 4 --steps 4 --out records/planner/gpt-default
    python -m bench.plan_accuracy --world 4 --out records/planner/gpt-default --report
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pycomm.parallel.job.config import parse


def _rank_main(rank: int, world: int, port: int, cfgs: list[Any], steps: int,
               out: str, time_only: bool) -> None:
    import torch.distributed as dist

    import pycomm  # noqa: F401  (registers the backend)
    from bench._plan_accuracy_rank import run_all

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("pycomm", store=store, rank=rank, world_size=world)
    try:
        run_all(rank, cfgs, steps, out, time_only)
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from pycomm.parallel.planner.layouts import enumerate_layouts, with_layout
    from pycomm.parallel.planner.shapes import model_shape

    cfg = parse(args.rest)
    layouts, _ = enumerate_layouts(cfg, args.world, model_shape(cfg), offloads=("none",))
    if args.only:
        layouts = [x for x in layouts if args.only in str(x)]
    out = Path(args.out + (".time.jsonl" if args.time_only else ".jsonl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cfgs = [with_layout(cfg, x) for x in layouts]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_rank_main, args=(args.world, store.port, cfgs, args.steps, str(out),
                               args.time_only), nprocs=args.world, join=True)
    print(f"{len(cfgs)} layouts -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_accuracy")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="steps per layout (>= 3)")
    parser.add_argument("--out", required=True, help="results path without suffix")
    parser.add_argument("--only", default="", help="layouts whose name contains this")
    parser.add_argument("--report", action="store_true", help="compare, write NAME.md")
    parser.add_argument("--time-only", action="store_true",
                        help="step times alone (--steps timed steps after a first), to "
                        "NAME.time.jsonl; the report takes each layout's fastest step")
    args, args.rest = parser.parse_known_args(argv)
    if args.report:
        from bench._plan_accuracy_report import report

        text = report(args)
        Path(args.out + ".md").write_text(text)
        print(text)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
