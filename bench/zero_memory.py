"""ZeRO's per-rank memory against the paper's formulas: ``python -m bench.zero_memory
--dp 2 4 --bucket-mb 25 1 [--out zero_memory.json]``.

The project GPT (~4.9M parameters, fp32) trained through the composed engine
(``parallelize(model, ParallelMesh(dp=N), ParallelConfig(zero=z, bucket_mb=C_B))``),
which reduces after backward (ZeRO's ``reduce_gradients``), for every stage 0-3. After a
first step (Adam's state appears), a second step is measured on every rank, from
outside the optimizer (bench._memory_probe, not ``memory_stats()``):

- **held between steps**: the unique tensor storages reachable from the engine after
  the step, by role: parameters, their gradients, optimizer state, and the rest
  (bucket buffers, stage 3's pooled whole units and persistent parameters, plain data
  parallelism's averaging buffer, which the gradients are views of);
- **peak**: the process's bytes in use (malloc plus pycomm's shared-memory arena) read
  after every aten op of the step, above what it used before the engine was built
  (activations included); and the rise of peak RSS over the step.

Formulas (fp32 parameters and gradients, Adam with K = 8 bytes of state per parameter,
the masters being the parameters themselves): stage 0 16Psi, stage 1 4Psi + 4Psi +
8Psi/N, stage 2 4Psi + 12Psi/N, stage 3 16Psi/N; each plus the buffers it states
(``ALLOWANCE`` below): stages 0-2 none between steps (stage 0's gradients are views of
its averaging buffer) (stage 1's buckets are views of its gradient; stage 2 gives each
bucket's buffer back once reduce-scattered), stage 3 its pool of whole-unit buffers
(at most 6 of the largest unit) and the parameters under its persistence threshold,
kept whole with their gradients.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench._memory_probe import PeakSampler, ProcessMeter, held_bytes, in_use

MB = 1 << 20
MODEL: dict[str, Any] = {"vocab_size": 256, "block_size": 128, "n_layer": 6, "n_head": 8,
                         "n_embd": 256}
ROWS = 2  # per rank
STAGES = (0, 1, 2, 3)
ALLOWANCE = {
    0: "0 (the gradients are views of the averaging buffer)",
    1: "0 (buckets are views of the gradient)",
    2: "0 (bucket buffers given back; 2 x bucket if kept whole)",
    3: "pool <= 6 x largest unit, + 8 B x persistent params",
}


def _model() -> Any:
    from pycomm.parallel.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def measure(zero: int, bucket_mb: float) -> dict[str, Any]:
    """On every rank: build the engine, train two steps, measure the second."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    dist.barrier()  # pycomm drops finished ops' tensors at the next op
    gc.collect()
    base = in_use()
    mesh = ParallelMesh(dp=dist.get_world_size())
    engine = parallelize(_model(), mesh, ParallelConfig(zero=zero, bucket_mb=bucket_mb))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, MODEL["vocab_size"], (ROWS * mesh.size("dp"),
                                                      MODEL["block_size"]), generator=gen)
               for _ in range(2)]
    engine.train_step(batches[0], batches[0])
    start = time.perf_counter()
    with ProcessMeter() as process, PeakSampler() as sampler:
        engine.train_step(batches[1], batches[1])
    seconds = time.perf_counter() - start
    held = held_bytes(engine)
    stats: dict[str, int] = getattr(engine.optimizer, "memory_stats", dict)()
    return {"rank": dist.get_rank(), "held": held, "buckets": _buckets(engine),
            "peak": sampler.peak - base,
            "after": sampler.after - base, "rss_peak_rise": process.rss_peak_rise,
            "malloc_net": process.malloc_net, "shm_net": process.shm_net,
            "step_s": seconds, "self_report": stats}


def _buckets(engine: Any) -> list[int]:
    """Bytes of each bucket the data-parallel side reduces (stage 3: each unit)."""
    layout = getattr(engine.optimizer, "layout", None)
    if layout is not None:
        return [b.shard * layout.world * layout.dtype.itemsize for b in layout.buckets]
    averager = getattr(getattr(engine, "dp", None), "averager", None)
    if averager is None:
        return []
    sizes = [p.numel() * p.element_size() for p in averager.params]
    return [sum(sizes[first:last]) for first, last in averager.buckets]


def formula(stage: int, psi: int, n: int) -> float:
    """The paper's bytes per rank: fp32 parameters and gradients, K = 8 (Adam)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n}[stage]


def allowance(stage: int, model: Any) -> float:
    """Bytes of the buffers each stage states beside the formula, between steps (the
    composed engine reduces after backward, where stage 2 streams at every cap)."""
    from pycomm.parallel.zero.sharded_model import DEFAULT_PERSISTENCE_THRESHOLD

    if stage == 3:
        unit = max(sum(p.numel() for p in block.parameters()) for block in model.blocks)
        small = sum(p.numel() for p in model.parameters()
                    if p.numel() < DEFAULT_PERSISTENCE_THRESHOLD)
        return 6 * 4 * unit + 8 * small
    return 0.0


def _row(run: dict[str, Any]) -> str:
    r, f, a = run["ranks"][0], run["formula"], run["allowance"]
    held, most = r["held"], max(x["held"]["total"] for x in run["ranks"])
    buckets = f"{len(r['buckets'])} x <= {max(r['buckets'], default=0) / MB:.2f}"
    cells = [run["dp"], f"{run['bucket_mb']:g}", buckets, run["stage"], held["params"] / MB,
             held["grads"] / MB, held["state"] / MB, held["other"] / MB, held["total"] / MB,
             most / MB, r["after"] / MB, f / MB, held["total"] / f, a / MB,
             held["total"] / (f + a), r["peak"] / MB, r["rss_peak_rise"] / MB]
    text = [c if isinstance(c, str) else f"{c:.2f}" if isinstance(c, float) else str(c)
            for c in cells]
    return "| " + " | ".join(text) + " |"


HEADER = ("| dp | C_B MB | buckets MB | stage | params MB | grads MB | opt state MB | "
          "buffers MB | held MB | held MB (max rank) | in use after MB | formula MB | "
          "held/formula | allowance MB | held/(formula+allowance) | peak MB | "
          "peak RSS rise MB |")
NOTES = [
    "held: tensor storages reachable from the engine after the step, by role (buffers: "
    "bucket buffers, pooled units, persistent parameters, averaging buffer); in use after, "
    "peak: the process's malloc + shared-memory bytes above its use before the engine was "
    "built, after / at the peak of the step (activations included); peak RSS rise: VmHWM "
    "over the step minus RSS at its start (noisy: it counts pages glibc keeps after frees).",
    "buckets: how many the data-parallel side reduces and the largest (stage 2 caps them "
    "at min(C_B, a quarter of what its shards leave of the gradient); stage 3: its units).",
]


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: rank 0's bytes held between steps (and the most any rank holds), the
    formula and allowance, and the step's peak."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [_row(run) for run in runs]
    lines.append("")
    lines += [f"- stage {s} allowance: {text}" for s, text in ALLOWANCE.items()]
    lines += [f"- {note}" for note in NOTES]
    return "\n".join(lines)


def run_all(dps: list[int], caps: list[float]) -> list[dict[str, Any]]:
    from pycomm.testing import RankPool

    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    runs = []
    for dp in dps:
        with RankPool(dp, backend="pycomm", pg_timeout_s=120) as pool:
            pool.run(measure, 0, caps[0], timeout_s=600)  # one-time allocations go first
            for cap in caps:
                for stage in STAGES:
                    ranks = pool.run(measure, stage, cap, timeout_s=600)
                    runs.append({"dp": dp, "bucket_mb": cap, "stage": stage, "psi": psi,
                                 "formula": formula(stage, psi, dp),
                                 "allowance": allowance(stage, model), "ranks": ranks})
                    print(_row(runs[-1]), file=sys.stderr, flush=True)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 1.0])
    parser.add_argument("--out", type=Path, default=None, help="write every rank's numbers")
    args = parser.parse_args(argv)
    runs = run_all(args.dp, args.bucket_mb)
    print(f"GPT {MODEL}: Psi = {runs[0]['psi']:,} parameters, fp32, AdamW; composed "
          f"engine (reduces after backward), {ROWS} rows of {MODEL['block_size']} tokens "
          "per rank; rank 0, second step.\n")
    print(table(runs))
    if args.out:
        args.out.write_text(json.dumps({"model": MODEL, "rows_per_rank": ROWS, "runs": runs},
                                       indent=1))


if __name__ == "__main__":
    main()
