"""Activation memory and recompute cost: ``python -m bench.recompute [--tp 2]``.

On the project's GPT, tensor-parallel over ``--tp`` spawned ranks (parallel.tensor),
one step each of: no checkpointing, every block checkpointed, and every block
checkpointed with its input partitioned across the TP group (ZeRO-R's P_a). For each:
the bytes autograd holds for backward (``ActivationMeter``), the bytes the checkpoint
arena holds (the blocks' inputs), peak RSS of a fresh set of ranks, and the step time
(median, interleaved rounds). The recompute overhead is the checkpointed step's time
over the plain one's.

The fused kernels (``apply_fused_kernels``) fuse only the unsharded GPT's MLP (a
tensor-parallel MLP's layers communicate), so the same run also measures the unsharded
model, one rank, plain and fused. Per block: the bytes a block's forward leaves saved
for backward (``ActivationMeter``'s count after the block's forward minus before it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
from pycomm.parallel.pipeline import ActivationMeter
from pycomm.parallel.recompute import (
    CheckpointArena,
    apply_activation_checkpointing,
    apply_fused_kernels,
)
from pycomm.parallel.tensor import (
    apply_tensor_parallel,
    model_parallel_seed,
    vocab_parallel_cross_entropy,
)
from pycomm.testing import run_ranks

MODES = ("plain", "checkpoint", "checkpoint+P_a")
UNSHARDED = ("unsharded plain", "unsharded fused")  # one rank, no parallel.tensor
MB = 1 << 20
CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=384)
TINY = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _build(mode: str, rows: int, cfg: GPTConfig) -> tuple[Any, Any, CheckpointArena]:
    group = dist.group.WORLD
    model_parallel_seed(0, group)  # torch's generator, and TP dropout's streams
    arena = CheckpointArena()
    if mode in UNSHARDED:
        net = GPT(cfg)
        if mode.endswith("fused"):
            apply_fused_kernels(net)
    else:
        net = apply_tensor_parallel(GPT(cfg), group)
        if mode != "plain":
            apply_activation_checkpointing(net, "every", arena=arena, partition_group=group
                                           if mode.endswith("P_a") else None)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if mode in UNSHARDED:
            return lm_loss(net(x), y)
        return vocab_parallel_cross_entropy(net(x), y, group).mean()

    def step(i: int, meter: ActivationMeter | None = None) -> None:
        x, y = synthetic_batch(cfg, rows, seed=i)
        opt.zero_grad()
        if meter is not None:
            with meter.measure(net):
                loss = loss_of(x, y)
        else:
            loss = loss_of(x, y)
        loss.backward()
        opt.step()

    return net, step, arena


def _block_bytes(net: Any, step: Any, meter: ActivationMeter) -> list[int]:
    """One measured step; per block, the bytes its forward left saved for backward."""
    before: dict[Any, int] = {}
    saved: list[int] = []
    hooks = [h for b in net.blocks for h in (
        b.register_forward_pre_hook(lambda m, args: before.__setitem__(m, meter.live)),
        b.register_forward_hook(lambda m, args, out: saved.append(meter.live - before[m])))]
    try:
        step(1, meter)
    finally:
        for h in hooks:
            h.remove()
    return saved


def time_modes(rows: int, rounds: int, steps: int, cfg: GPTConfig,
               modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    torch.set_num_threads(1)
    built = {mode: _build(mode, rows, cfg) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    out: dict[str, Any] = {}
    for mode, (net, step, arena) in built.items():
        meter = ActivationMeter()
        step(0, meter)  # also the warm-up (the arena grows to fit here)
        blocks = _block_bytes(net, step, meter)
        out[mode] = {"saved_bytes": meter.peak_bytes, "arena_bytes": arena.stats()["peak_bytes"],
                     "block_saved_bytes": statistics.mean(blocks), "blocks": len(blocks)}
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            dist.barrier()
            for i in range(steps):
                start = time.perf_counter()
                built[mode][1](10 + i)
                times[mode].append(time.perf_counter() - start)
    for mode in modes:
        out[mode]["times_s"] = times[mode]
    return out


def peak_rss(mode: str, rows: int, cfg: GPTConfig) -> int:
    """Peak RSS of this (fresh) process after three steps of ``mode``."""
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
    p.add_argument("--dropout", type=float, default=0.1,
                   help="the GPT's dropout (its masks are what the fused kernels keep as seeds)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--kernels-only", action="store_true",
                   help="only the fused-kernel table (one process)")
    p.add_argument("-o", "--out", type=Path, default=Path("bench/out/recompute.json"))
    args = p.parse_args(argv)
    cfg = dataclasses.replace(TINY if args.tiny else CFG, dropout=args.dropout)
    shapes = [(2, 16, 64)] if args.tiny else [(4, 64, 1536), (8, 128, 1536), (8, 128, 6144)]
    kernels = kernel_table(shapes)
    print_kernel_table(kernels)
    if args.kernels_only:
        return
    rows = _measure(MODES, args.tp, args, cfg)
    unsharded = _measure(UNSHARDED, 1, args, cfg)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "results": rows, "unsharded": unsharded, "kernels": kernels},
                                   indent=1))
    _print_modes(rows, args, cfg)
    _print_blocks(unsharded, rows, args.tp)
    print(f"# wrote {args.out}")


def _measure(modes: tuple[str, ...], world: int, args: Any, cfg: GPTConfig) -> dict[str, Any]:
    """Each mode's times (slowest rank, median), memory (rank 0) and peak RSS."""
    per_rank = run_ranks(time_modes, world, args.rows, args.rounds, args.steps, cfg, modes,
                         timeout_s=1800.0)
    rows = {}
    for mode in modes:
        slowest = [max(s) for s in zip(*(r[mode]["times_s"] for r in per_rank), strict=True)]
        rss = run_ranks(peak_rss, world, mode, args.rows, cfg, timeout_s=600.0)
        first = per_rank[0][mode]
        rows[mode] = {"median_ms": statistics.median(slowest) * 1e3,
                      "saved_mb": first["saved_bytes"] / MB,
                      "arena_mb": first["arena_bytes"] / MB,
                      "block_saved_mb": first["block_saved_bytes"] / MB,
                      "block_arena_mb": first["arena_bytes"] / first["blocks"] / MB,
                      "peak_rss_mb": max(rss) / MB}
    return rows


def _print_modes(rows: dict[str, Any], args: Any, cfg: GPTConfig) -> None:
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


def _print_blocks(unsharded: dict[str, Any], rows: dict[str, Any], tp: int) -> None:
    print("# per block: bytes its forward leaves for backward (autograd, saved-tensor hooks) "
          "and its input in the checkpoint arena; (a), (b) on the unsharded model (one rank: "
          f"the fused kernels fuse only its MLP), (a), (c), (d) per rank at TP={tp}")
    print(f"{'row':<26} {'block saved MB':>15} {'block arena MB':>15} {'block total MB':>15} "
          f"{'model saved MB':>15} {'peak RSS MB':>12} {'step ms':>8}")
    labelled = [("(a) plain, unsharded", unsharded["unsharded plain"]),
                ("(b) fused, unsharded", unsharded["unsharded fused"]),
                (f"(a) plain, TP={tp}", rows["plain"]),
                (f"(c) checkpointed, TP={tp}", rows["checkpoint"]),
                (f"(d) ckpt + P_a, TP={tp}", rows["checkpoint+P_a"])]
    for label, r in labelled:
        block = r["block_saved_mb"] + r["block_arena_mb"]
        print(f"{label:<26} {r['block_saved_mb']:>15.3f} {r['block_arena_mb']:>15.3f} "
              f"{block:>15.3f} {r['saved_mb'] + r['arena_mb']:>15.2f} "
              f"{r['peak_rss_mb']:>12.0f} {r['median_ms']:>8.1f}")


def kernel_table(shapes: list[tuple[int, ...]], repeats: int = 20) -> list[dict[str, Any]]:
    """Forward + backward time and saved bytes, fused against unfused, one process."""
    import torch.nn.functional as F

    from pycomm.parallel.recompute import fused_bias_dropout_add, fused_bias_gelu

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
