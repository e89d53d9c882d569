"""The dispatch benchmark's baseline: the same chain as a multi-controller SPMD program.

Run under torchrun (``python -m torch.distributed.run --nproc-per-node R -m
bench._pathways_spmd ...``): every rank runs the chain itself, no controller; rank 0
writes microseconds per step for each compute length.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from bench._pathways_steps import chain_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--computes-us", required=True)
    p.add_argument("--chain", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kind", default="sleep")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    import pycomm  # noqa: F401  (registers the backend)

    dist.init_process_group("pycomm")
    torch.set_num_threads(1)
    out: dict[str, list[float]] = {}
    x = torch.ones(8, dtype=torch.float64)
    for us in (float(c) for c in a.computes_us.split(",")):
        runs = []
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            y = x
            for _ in range(a.chain):
                y = chain_step(y, None, us * 1e-6, a.kind)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            runs.append(float(elapsed) / a.chain * 1e6)
        out[f"{us:g}"] = runs
    if dist.get_rank() == 0:
        with open(a.json, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
