"""Rank side of ``bench.training buckets``: C_B alone.

All-reduce a model's gradient tensors one by one (each its own async collective, as
without bucketing) against the same bytes in constant-size buckets (one collective
per bucket, on an arena: zero-copy on pycomm), interleaved iteration by iteration.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pycomm import Arena, Bucketer, plan_buckets
from pycomm.parallel.models import GPT, GPTConfig


def _one_by_one(grads: list[torch.Tensor], group: Any) -> None:
    works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group, async_op=True) for g in grads]
    for work in works:
        work.wait()


def _bucketed(bucketer: Bucketer, count: int) -> None:
    bucketer.reset()
    for i in range(count):  # items are already in ready order
        bucketer.mark_ready(i)
    bucketer.wait()


def _bucketer(grads: list[torch.Tensor], group: Any, cap_mb: float) -> Bucketer:
    numel = sum(g.numel() for g in grads) + 64 * len(grads)
    arena = Arena.for_group(numel, torch.float32, group)
    views = [arena.allocate(g.numel()) for g in grads]
    plan = plan_buckets([v.numel() * 4 for v in views], int(cap_mb * (1 << 20)))
    starts = [arena.offset_of(views[b[0]]) for b in plan]
    ends = [arena.offset_of(views[b[-1]]) + views[b[-1]].numel() for b in plan]
    slices = [arena.buffer[s:e] for s, e in zip(starts, ends, strict=True)]
    return Bucketer(plan, lambda k: dist.all_reduce(slices[k], group=group, async_op=True))


def time_bucketing(cfg: GPTConfig, cap_mb: float, iters: int, backends: list[str]) -> dict:
    """Per backend: median seconds for one-by-one and bucketed, and the counts."""
    torch.set_num_threads(1)
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in reversed(list(GPT(cfg).parameters()))]
    out = {}
    for name in backends:
        group = groups[name]
        bucketer = _bucketer(grads, group, cap_mb)
        times: dict[str, list[float]] = {"one_by_one": [], "bucketed": []}
        for i in range(iters + 2):  # two warm-up iterations
            for kind in ("one_by_one", "bucketed") if i % 2 else ("bucketed", "one_by_one"):
                dist.barrier(group)
                start = time.perf_counter()
                if kind == "one_by_one":
                    _one_by_one(grads, group)
                else:
                    _bucketed(bucketer, len(grads))
                if i >= 2:
                    times[kind].append(time.perf_counter() - start)
        out[name] = {
            "tensors": len(grads),
            "buckets": bucketer.num_buckets,
            "bytes": sum(g.numel() * 4 for g in grads),
            **{f"{k}_s": statistics.median(v) for k, v in times.items()},
        }
    return out
