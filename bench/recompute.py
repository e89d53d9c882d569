"""Activation memory and recompute cost: ``python -m bench.recompute [--tp 2]``.

On the project's GPT, tensor-parallel over ``--tp`` spawned ranks (parallel.tensor),
one step each of: no checkpointing, every block checkpointed, and every block
checkpointed with its input partitioned across the TP group (ZeRO-R's P_a). For each:
the bytes autograd holds for backward (``ActivationMeter``), the bytes the checkpoint
arena holds (the blocks' inputs), peak RSS of a fresh set of ranks, and the step time
(median, interleaved rounds). The recompute overhead is the checkpointed step's time
over the plain one's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel.models import GPT, GPTConfig, synthetic_batch
from parallel.pipeline import ActivationMeter
from parallel.recompute import CheckpointArena, apply_activation_checkpointing
from parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from pycomm.testing import run_ranks

MODES = ("plain", "checkpoint", "checkpoint+P_a")
MB = 1 << 20
CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=384)
TINY = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _build(mode: str, rows: int, cfg: GPTConfig) -> tuple[Any, Any, CheckpointArena]:
    group = dist.group.WORLD
    torch.manual_seed(0)
    net = apply_tensor_parallel(GPT(cfg), group)
    arena = CheckpointArena()
    if mode != "plain":
        apply_activation_checkpointing(net, "every", arena=arena,
                                       partition_group=group if mode.endswith("P_a") else None)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step(i: int, meter: ActivationMeter | None = None) -> None:
        x, y = synthetic_batch(cfg, rows, seed=i)
        opt.zero_grad()
        if meter is not None:
            with meter.measure(net):
                loss = vocab_parallel_cross_entropy(net(x), y, group).mean()
        else:
            loss = vocab_parallel_cross_entropy(net(x), y, group).mean()
        loss.backward()
        opt.step()

    return net, step, arena


def time_modes(rows: int, rounds: int, steps: int, cfg: GPTConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    built = {mode: _build(mode, rows, cfg) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    out: dict[str, Any] = {}
    for mode, (_, step, arena) in built.items():
        meter = ActivationMeter()
        step(0, meter)  # also the warm-up (the arena grows to fit here)
        step(1, meter)
        out[mode] = {"saved_bytes": meter.peak_bytes, "arena_bytes": arena.stats()["peak_bytes"]}
    for r in range(rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            dist.barrier()
            for i in range(steps):
                start = time.perf_counter()
                built[mode][1](10 + i)
                times[mode].append(time.perf_counter() - start)
    for mode in MODES:
        out[mode]["times_s"] = times[mode]
    return out


def peak_rss(mode: str, rows: int, cfg: GPTConfig) -> int:
    torch.set_num_threads(1)
    _, step, _ = _build(mode, rows, cfg)
    for i in range(3):
        step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.recompute", description=__doc__)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="sequences per step")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--kernels-only", action="store_true",
                   help="only the fused-kernel table (one process)")
    p.add_argument("-o", "--out", type=Path, default=Path("bench/results/recompute.json"))
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else CFG
    shapes = [(2, 16, 64)] if args.tiny else [(4, 64, 1536), (8, 128, 1536), (8, 128, 6144)]
    kernels = kernel_table(shapes)
    print_kernel_table(kernels)
    if args.kernels_only:
        return
    per_rank = run_ranks(time_modes, args.tp, args.rows, args.rounds, args.steps, cfg,
                         timeout_s=1800.0)
    rows = {}
    for mode in MODES:
        slowest = [max(s) for s in zip(*(r[mode]["times_s"] for r in per_rank), strict=True)]
        rss = run_ranks(peak_rss, args.tp, mode, args.rows, cfg, timeout_s=600.0)
        rows[mode] = {"median_ms": statistics.median(slowest) * 1e3,
                      "saved_mb": per_rank[0][mode]["saved_bytes"] / MB,
                      "arena_mb": per_rank[0][mode]["arena_bytes"] / MB,
                      "peak_rss_mb": max(rss) / MB}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "results": rows, "kernels": kernels}, indent=1))
    print(f"# bench.recompute: GPT {cfg}, TP={args.tp} (parallel.tensor), {args.rows} "
          f"sequences of {cfg.block_size} tokens, SGD; {args.rounds} rounds x {args.steps} "
          "steps interleaved, slowest rank, median; memory per rank (rank 0)")
    print(f"{'mode':<16} {'step ms':>9} {'autograd-saved MB':>18} {'checkpoint arena MB':>20} "
          f"{'total MB':>9} {'peak RSS MB':>12}")
    for mode, r in rows.items():
        total = r["saved_mb"] + r["arena_mb"]
        print(f"{mode:<16} {r['median_ms']:>9.1f} {r['saved_mb']:>18.2f} {r['arena_mb']:>20.3f} "
              f"{total:>9.2f} {r['peak_rss_mb']:>12.0f}")
    plain, ckpt = rows["plain"]["median_ms"], rows["checkpoint"]["median_ms"]
    print(f"# recompute overhead: checkpoint / plain step time = {ckpt / plain:.3f} "
          f"(+{(ckpt / plain - 1) * 100:.0f}%; the paper's figure is 20-30%)")
    pa, full = rows["checkpoint+P_a"]["arena_mb"], rows["checkpoint"]["arena_mb"]
    print(f"# P_a: checkpointed inputs per rank {pa:.3f} MB against {full:.3f} MB "
          f"({pa / full:.3f}; 1/TP = {1 / args.tp:.3f})")
    print(f"# wrote {args.out}")



def kernel_table(shapes: list[tuple[int, ...]], repeats: int = 20) -> list[dict[str, Any]]:
    """Forward + backward time and saved bytes, fused against unfused, one process."""
    import torch.nn.functional as F

    from parallel.recompute import fused_bias_dropout_add, fused_bias_gelu

    ops = {
        "bias+gelu": (lambda x, b, r: F.gelu(x + b), lambda x, b, r: fused_bias_gelu(x, b)),
        "bias+dropout(0.1)+add": (lambda x, b, r: F.dropout(x + b, 0.1, True) + r,
                                  lambda x, b, r: fused_bias_dropout_add(x, b, r, 0.1, True)),
    }
    rows = []
    for shape in shapes:
        x = torch.randn(shape, requires_grad=True)
        b = torch.randn(shape[-1], requires_grad=True)
        r = torch.randn(shape, requires_grad=True)
        g = torch.randn(shape)
        for name, (unfused, fused) in ops.items():
            row: dict[str, Any] = {"op": name, "shape": list(shape)}
            for label, fn in (("unfused", unfused), ("fused", fused)):
                meter = ActivationMeter()
                with meter.measure(exclude=(x, b, r)):  # the inputs exist anyway
                    out = fn(x, b, r)
                out.backward(g)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn(x, b, r).backward(g)
                    times.append(time.perf_counter() - start)
                row[f"{label}_ms"] = statistics.median(times) * 1e3
                row[f"{label}_saved_mb"] = meter.peak_bytes / MB
            rows.append(row)
    return rows


def print_kernel_table(rows: list[dict[str, Any]]) -> None:
    print(f"# fused recompute kernels: forward + backward, median of 20, {torch.get_num_threads()}"
          " threads; saved = bytes the op keeps for backward beyond its inputs")
    print(f"{'op':<24} {'shape':<16} {'unfused ms':>11} {'fused ms':>9} {'speed-up':>9} "
          f"{'unfused saved MB':>17} {'fused saved MB':>15}")
    for r in rows:
        print(f"{r['op']:<24} {tuple(r['shape'])!s:<16} {r['unfused_ms']:>11.2f} "
              f"{r['fused_ms']:>9.2f} {r['unfused_ms'] / r['fused_ms']:>8.2f}x "
              f"{r['unfused_saved_mb']:>17.2f} {r['fused_saved_mb']:>15.2f}")


if __name__ == "__main__":
    main()
