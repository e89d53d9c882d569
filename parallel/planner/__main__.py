"""``python -m pycomm.parallel.planner``: the layouts of a model on N ranks, predicted and
ranked."""

from __future__ import annotations

import sys

from .cli import build_parser, memory_gib, parse_args
from .planner import GIB, evaluate
from .report import table, write_json


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, cfg = parse_args(argv, parser)
        limit = memory_gib(args.memory_gb, args.world)
        rows, refused = evaluate(cfg, args.world, limit, args.calibration, args.comm_results,
                                 other_load=args.other_load)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fitting = sum(r.fits for r in rows)
    print(f"{cfg.model} n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} "
          f"block_size={cfg.block_size} batch={cfg.batch_size} on {args.world} ranks, "
          f"{limit:.3f} GiB each: {len(rows)} layouts accepted, {fitting} fit, "
          f"{len(refused)} refused")
    print("\n".join(table(rows, args.top)))
    if rows and rows[0].fits:
        print(f"\nbest: {rows[0].layout} ({rows[0].peak / GIB:.3f} GiB, "
              f"{rows[0].time.total:.3f} s/step): python -m pycomm.parallel.train "
              + " ".join(rows[0].layout.flags()))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
