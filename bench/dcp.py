"""``python -m bench.dcp``: a sharded checkpoint through a run, in numbers.

A ~4.9M-parameter HuggingFace Llama (or the project's GPT, ``--model gpt``) trains 20
steps at 2x2x1 (ZeRO-1), saving after step 10; the checkpoint resumes at 1x2x2 (ZeRO-3)
and in one process, and steps 11-20 are compared with the uninterrupted run. Printed
per rank: the bytes of tensor data its files hold and what the save added to its
resident memory at its peak, beside what gathering the whole model and its Adam state
(the former ``engine.save``) would have held; and the HuggingFace export reloaded by
``from_pretrained`` against the engine's logits.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench import _dcp_runs as dr
from bench import _model_zoo as zoo
from bench._provenance import write_report


def main(argv: list[str] | None = None) -> None:
    from pycomm.testing import RankPool

    parser = argparse.ArgumentParser(prog="python -m bench.dcp")
    parser.add_argument("--model", default="llama", choices=("llama", "gpt", "qwen2"))
    parser.add_argument("--out", help="JSON of the figures")
    args = parser.parse_args(argv)
    size, recipe = zoo.MEDIUM, zoo.Recipe(steps=20)
    root = Path(tempfile.mkdtemp(prefix="pycomm-dcp-"))
    path = str(root / "ckpt")
    with RankPool(4, backend="pycomm", pg_timeout_s=300) as pool:
        ranks = pool.run(dr.save_then_train, args.model, (2, 2, 1), 1, recipe, 10, path, size,
                         timeout_s=1200)
        other = pool.run(dr.resume, args.model, (1, 2, 2), 3, recipe, path, size,
                         timeout_s=1200)[0]
    with RankPool(1, backend="pycomm", pg_timeout_s=300) as pool:
        alone = pool.run(dr.resume, args.model, (1, 1, 1), 0, recipe, path, size,
                         timeout_s=1200)[0]
    whole = ranks[0]["losses"]
    params = sum(p.numel() for p in zoo.build(args.model, size=size).parameters())
    report = {
        "model": args.model, "params": params, "gathered_bytes": 12 * params,
        "per_rank": [{"rank": r, "payload_bytes": x["bytes"], "save_added_rss": x["save_added"]}
                     for r, x in enumerate(ranks)],
        "resumed": {name: max(abs(a / b - 1) for a, b in zip(run["losses"], whole[10:],
                                                               strict=True))
                    for name, run in (("1x2x2 zero3", other), ("1x1x1", alone))},
    }
    if args.model != "gpt":
        got = dr.exported_logits(args.model, path, str(root / "hf"), size)
        report["export_logits_max_abs_diff"] = float((got - ranks[0]["logits"]).abs().max())
    print(json.dumps(report, indent=1))
    write_report(report, args.out)


if __name__ == "__main__":
    main()
