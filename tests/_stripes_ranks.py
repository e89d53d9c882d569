"""Ranks of tests/test_stripes.py: all_reduces striped over PYCOMM_STRIPES communicators.

Each case makes its own group with the stripes set in the environment when the group is
created (rank 0's settings are the group's), so one spawn runs every case.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from unittest.mock import patch

import torch
import torch.distributed as dist

import pycomm

STRIPE_BYTES = 4096  # small, so that modest tensors are striped


def striped_group(stripes: int = 4, stripe_bytes: int = STRIPE_BYTES):
    with patch.dict(os.environ, {"PYCOMM_STRIPES": str(stripes),
                                 "PYCOMM_STRIPE_BYTES": str(stripe_bytes)}):
        return dist.new_group(backend="pycomm")


def stripe_threads() -> list[str]:
    """Names of this process's threads that are a stripe's."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith("pycomm-stripe"):
            names.append(name)
    return sorted(names)


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent values every dtype holds exactly enough for the test's tolerance."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=dtype)


def _expected(world: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction in float64 over every rank's input (each rank makes them all)."""
    xs = torch.stack([_input(r, numel, dtype).to(torch.float64) for r in range(world)])
    if op == "sum":
        return xs.sum(0)
    if op == "avg":
        return xs.mean(0)
    if op == "max":
        return xs.max(0).values
    if op == "min":
        return xs.min(0).values
    return xs.prod(0)


_REDOPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}

# numel chosen around the stripes' cut: not striped (below 4 KB), striped into parts of
# whole cache lines, and counts that do not divide into lines or stripes.
CASES = [
    (torch.float64, "sum", 100),
    (torch.float64, "sum", 5000),
    (torch.float64, "avg", 100_003),
    (torch.float64, "max", 4099),
    (torch.float32, "sum", 262_147),
    (torch.float32, "prod", 20_000),
    (torch.bfloat16, "sum", 65_537),
    (torch.int32, "sum", 33_333),
    (torch.int64, "min", 8191),
]


def numerics() -> list[dict]:
    """Every case through dist.all_reduce, pycomm.all_reduce_, an async op and a
    non-contiguous tensor; the largest error against float64 per case."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = striped_group()
    out = []
    for dtype, op, numel in CASES:
        want = _expected(world, numel, dtype, op)
        for how in ("dist", "api", "async", "strided"):
            x = _input(rank, numel, dtype)
            if how == "dist":
                dist.all_reduce(x, op=_REDOPS[op], group=group)
            elif how == "api":
                pycomm.all_reduce_(x, op, group)
            elif how == "async":
                w = dist.all_reduce(x, op=_REDOPS[op], group=group,
                                    async_op=True)
                w.wait()
            else:  # every other element of a tensor twice as long
                big = torch.zeros(2 * numel, dtype=dtype)
                big[::2] = x
                view = big[::2]
                dist.all_reduce(view, op=_REDOPS[op], group=group)
                assert bool((big[1::2] == 0).all()), "the gaps of a strided tensor changed"
                x = view
            err = (x.to(torch.float64) - want).abs().max().item()
            out.append({"dtype": str(dtype), "op": op, "numel": numel, "how": how, "err": err,
                        "scale": want.abs().max().item()})
    dist.destroy_process_group(group)
    return out


def coalesced_and_premul() -> list[float]:
    """all_reduce_coalesced over a striped group (DDP's and FSDP's bucket path) and
    PREMUL_SUM (torch's gradient averaging): largest errors against float64."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = striped_group()
    sizes = [7, 3000, 50_001]
    xs = [_input(rank * 10 + i, n, torch.float64) for i, n in enumerate(sizes)]
    want = [sum(_input(r * 10 + i, n, torch.float64) for r in range(world))
            for i, n in enumerate(sizes)]
    dist.all_reduce_coalesced(xs, group=group)
    errs = [(x - w).abs().max().item() for x, w in zip(xs, want, strict=True)]
    y = _input(rank, 40_000, torch.float64)
    premul = dist._make_nccl_premul_sum(0.25)
    dist.all_reduce(y, op=premul, group=group)
    ref = 0.25 * sum(_input(r, 40_000, torch.float64) for r in range(world))
    errs.append((y - ref).abs().max().item())
    dist.destroy_process_group(group)
    return errs


def threads_and_settings() -> dict:
    """Stripe threads while a striped group lives, none after; rank 0's count applies."""
    before = stripe_threads()
    group = striped_group(stripes=int(os.environ.get("STRIPES_HERE", "3")))
    during = stripe_threads()
    x = torch.ones(100_000)
    dist.all_reduce(x, group=group)
    dist.destroy_process_group(group)
    return {"before": before, "during": during, "after": stripe_threads(),
            "value": x[0].item()}


def mismatch(numel_by_rank: list[int]) -> dict:
    """Ranks that disagree on the count (striped differently, or one not striped at all)
    raise, on every rank, well before the group's timeout."""
    rank = dist.get_rank()
    group = striped_group()
    x = torch.ones(numel_by_rank[rank])
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        error = ""
    except Exception as e:  # the test reads the message
        error = f"{type(e).__name__}: {e}"
    took = time.monotonic() - start
    with contextlib.suppress(Exception):  # a failed group may refuse a clean exit
        dist.destroy_process_group(group)
    return {"error": error, "seconds": took}


def ddp_step() -> float:
    """One DDP step on a striped group (its 25 MB buckets are striped) against the
    gradients one process computes from the whole batch: the largest difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 64)).double()
    reference = copy.deepcopy(model)
    group = striped_group(stripe_bytes=64 * 1024)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(8 * world, 256, generator=g, dtype=torch.float64)
    ddp(batch[8 * rank:8 * (rank + 1)]).square().mean().backward()
    reference(batch).square().mean().backward()
    diff = max((p.grad - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    dist.destroy_process_group(group)
    return diff
