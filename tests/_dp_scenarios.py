"""What each rank runs for tests/test_data_parallel.py, and the single-process references.

All scenarios run in one spawn per world size (``run_all``), on two explicitly passed
groups: the default ``pycomm`` group and a ``gloo`` group over the same ranks.
"""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.parallel.data import DataParallel
from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
ROWS_PER_RANK = 2
STEPS = 4
# Small caps so the tiny model fills several buckets (and the first is smaller).
CAPS = {"bucket_cap_mb": 16 / 1024, "first_bucket_mb": 4 / 1024}


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batch(step: int, world: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or rank ``rank``'s rows of it."""
    x, y = synthetic_batch(CFG, ROWS_PER_RANK * world, seed=100 + step)
    if rank is None:
        return x, y
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return x[rows], y[rows]


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(world: int, optim: str, micro: int = 1) -> dict[str, Any]:
    """One process, the whole batch of every rank, the same optimizer."""
    net = model()
    opt = make_optimizer(net.parameters(), optim)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, world)
            loss = lm_loss(net(x), y) / micro
            loss.backward()
        losses.append(loss.item() * micro)
        opt.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "losses": losses}


def train(group: dist.ProcessGroup, optim: str, micro: int = 1, **dp_kwargs: Any) -> dict[str, Any]:
    """STEPS optimizer steps of DataParallel; the last ``micro``-1 backward passes of
    each step accumulate under no_sync."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dp = DataParallel(model(seed=rank), process_group=group, **{**CAPS, **dp_kwargs})
    opt = make_optimizer(dp.parameters(), optim)
    losses, arena_ptrs = [], set()
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, world, rank)
            sync = m == micro - 1
            with dp.no_sync() if not sync else contextlib.nullcontext():
                loss = lm_loss(dp(x), y) / micro
                loss.backward()
        losses.append(loss.item() * micro)
        arena_ptrs.add(dp.arena.buffer.data_ptr())
        opt.step()
    in_arena = all(dp.arena.offset_of(p.grad) >= 0 for p in dp.parameters())
    return {"params": [p.detach().clone() for p in dp.module.parameters()], "losses": losses,
            "stats": dp.comm_stats(), "arena_ptrs": len(arena_ptrs), "grads_in_arena": in_arena}


def overlap_trace(group: dist.ProcessGroup) -> list[tuple[str, int, float]]:
    """The event trace of a synced step (second step: after the bucket rebuild)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dp = DataParallel(model(), process_group=group, **CAPS)
    for step in range(2):
        x, y = batch(step, world, rank)
        lm_loss(dp(x), y).backward()
    # Completion callbacks run on the backend's thread and may trail wait() a little.
    deadline = time.monotonic() + 10
    while _count(dp.trace, "complete") < _count(dp.trace, "launch"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return dp.trace


def _count(trace: list, kind: str) -> int:
    return sum(event[0] == kind for event in trace)


class WithUnused(nn.Module):
    """A GPT plus a head that only rank 0 uses, and one no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = model()
        self.rank0_head = nn.Linear(CFG.vocab_size, 1)
        self.never_used = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        logits = self.gpt(x)
        return logits + self.rank0_head(logits) if use_head else logits


def unused(group: dist.ProcessGroup) -> dict[str, Any]:
    """Without find_unused_parameters: the error. With it: gradients and None grads."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, y = batch(0, world, rank)
    strict = DataParallel(WithUnused(), process_group=group, **CAPS)
    try:
        lm_loss(strict(x, use_head=True), y).backward()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    dist.barrier(group)
    lenient = DataParallel(WithUnused(), process_group=group, find_unused_parameters=True, **CAPS)
    lm_loss(lenient(x, use_head=rank == 0), y).backward()
    net = lenient.module
    return {"error": error, "never_used_grad": net.never_used.weight.grad,
            "head_grad": net.rank0_head.weight.grad.clone(),
            "gpt_grads": [p.grad.clone() for p in net.gpt.parameters()]}


def memory(group: dist.ProcessGroup) -> dict[str, Any]:
    """RSS after steps 2 and 10 of a model with ~1.6M parameters (6 MB of gradients)."""
    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=4, n_head=4, n_embd=160)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    dp = DataParallel(GPT(cfg), process_group=group, bucket_cap_mb=1, first_bucket_mb=0.25)
    opt = torch.optim.SGD(dp.parameters(), lr=0.01, momentum=0.9)
    rss = {}
    for step in range(1, 11):
        x, y = synthetic_batch(cfg, 2 * world, seed=step)
        opt.zero_grad()
        lm_loss(dp(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        rss[step] = _rss_bytes()
    grad_bytes = sum(p.numel() * 4 for p in dp.parameters())
    return {"rss": rss, "grad_bytes": grad_bytes, "stats": dp.comm_stats(),
            "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_all(world: int) -> dict[str, Any]:
    """Every scenario on the pycomm default group and on a gloo group of the same ranks."""
    gloo = dist.new_group(backend="gloo")
    groups = {"pycomm": dist.group.WORLD, "gloo": gloo}
    out: dict[str, Any] = {}
    for name, group in groups.items():
        start = time.perf_counter()
        cases = {
            "sgd": lambda g: train(g, "sgd"),
            "adamw": lambda g: train(g, "adamw"),
            "no_sync": lambda g: train(g, "sgd", micro=2),
            "overlap": overlap_trace,
            "unused": unused,
        }
        if world == 2:
            cases["memory"] = memory
        out[name] = {"seconds": {}}
        for case, fn in cases.items():
            start = time.perf_counter()
            out[name][case] = fn(group)
            out[name]["seconds"][case] = round(time.perf_counter() - start, 2)
    return out
