"""Rank side of ``bench.training data``: one model per strategy, timed step by step.

Every strategy starts from the same weights and trains on the same per-rank batches;
the strategies take turns (a few steps each, order rotating every round) so machine
noise hits all of them alike.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench._tensor_wrap import local_numel
from pycomm.parallel.data import DataParallel
from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch

# name: (how the model is wrapped, the optimizer, which group it talks over)
STRATEGIES = {
    "local": ("none", "sgd", "none"),  # the same step without any communication
    "ddp-gloo": ("ddp", "sgd", "gloo"),
    "ddp-pycomm": ("ddp", "sgd", "pycomm"),
    # DDP (gradients as bucket views) built and stepped in pycomm.use_arena(): its buckets
    # in the shared-memory arena, so its all-reduces are zero-copy
    "ddp-pycomm-arena": ("ddp-arena", "sgd", "pycomm"),
    "parallel.data-pycomm": ("data", "sgd", "pycomm"),
    "parallel.data-gloo": ("data", "sgd", "gloo"),
}
# ZeRO against its torch peers, with AdamW (whose state is what ZeRO shards).
ZERO_STRATEGIES = {
    f"{name}-{group}": (wrap, optim, group)
    for group in ("pycomm", "gloo")
    for name, wrap, optim in (
        ("ddp-adamw", "ddp", "adamw"),
        ("torch-zero1", "ddp", "torch-zero"),  # DDP + torch's ZeroRedundancyOptimizer
        ("parallel.zero1", "none", "zero1"),
        ("parallel.zero2", "none", "zero2"),
        ("torch-fsdp2", "fsdp2", "adamw"),  # fully_shard per block and root: stage 3 peer
        ("parallel.zero3", "zero3", "zero3"),
    )
}
# The same with bf16 compute and communication (fp32 masters and state): on request.
MIXED_STRATEGIES = {
    f"{name}-{group}": (wrap, optim, group)
    for group in ("pycomm", "gloo")
    for name, wrap, optim in (
        ("torch-fsdp2-bf16", "fsdp2-bf16", "adamw"),
        ("parallel.zero3-bf16", "zero3", "zero3-bf16"),
    )
}
# Tensor parallelism: every rank of the group sees the same batch.
TENSOR_STRATEGIES = {
    "unsharded": ("none", "sgd", "none"),  # the whole model on each rank, no communication
    **{f"{name}-{group}": (wrap, "sgd", group)
       for group in ("pycomm", "gloo")
       for name, wrap in (("dtensor-tp", "dtensor"), ("dtensor-tp-sp", "dtensor-sp"),
                          ("parallel.tensor", "tp"), ("parallel.tensor-sp", "tp-sp"))},
}
ALL_STRATEGIES = {**STRATEGIES, **ZERO_STRATEGIES, **MIXED_STRATEGIES, **TENSOR_STRATEGIES}


@dataclass
class Setup:
    cfg: GPTConfig
    batch: int  # sequences per rank per step
    steps: int  # timed steps per strategy
    warmup: int
    bucket_cap_mb: float
    rounds: int


def _wrap(kind: str, group: dist.ProcessGroup | None, net: nn.Module, cap_mb: float) -> nn.Module:
    if kind == "ddp":
        return DDP(net, process_group=group, bucket_cap_mb=cap_mb)
    if kind == "ddp-arena":
        return DDP(net, process_group=group, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    if kind == "data":
        return DataParallel(net, process_group=group, bucket_cap_mb=cap_mb)
    if kind.startswith("fsdp2"):
        return _fully_shard(net, group, bf16=kind.endswith("bf16"))
    if kind == "zero3":
        from pycomm.parallel.zero import shard_model

        return shard_model(net, group)
    if kind.startswith(("dtensor", "tp")):
        from bench._tensor_wrap import dtensor_tp, parallel_tp

        wrap = dtensor_tp if kind.startswith("dtensor") else parallel_tp
        return wrap(net, group, sp=kind.endswith("-sp"))
    return net


def _fully_shard(net: nn.Module, group: dist.ProcessGroup | None, bf16: bool) -> nn.Module:
    """FSDP2 as its docs wrap a transformer: each block, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in net.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    return net


def _optimizer(kind: str, net: nn.Module, group: Any, cap_mb: float) -> Any:
    from pycomm.parallel.zero import ZeroOptimizer

    if kind == "sgd":
        return torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=1e-4)
    if kind == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, process_group=group,
                                       lr=1e-4)
    stage = int(kind.removeprefix("zero")[0])
    mixed = torch.bfloat16 if kind.endswith("bf16") else None
    return ZeroOptimizer(net.parameters(), torch.optim.AdamW, stage=stage, process_group=group,
                         bucket_cap_mb=cap_mb, mixed_precision=mixed, lr=1e-4)


def build(name: str, setup: Setup, groups: dict[str, Any]) -> tuple[nn.Module, Callable]:
    """The wrapped model and a function that runs one training step on it."""
    kind, optim, group = ALL_STRATEGIES[name]
    torch.manual_seed(0)
    in_block = _allocations(kind)
    with in_block():
        net = _wrap(kind, groups.get(group), GPT(setup.cfg), setup.bucket_cap_mb)
    opt = _optimizer(optim, net, groups.get(group), setup.bucket_cap_mb)
    net.zero_optimizer = opt if hasattr(opt, "memory_stats") else None  # for peak_memory
    # Tensor-parallel ranks share one batch; data-parallel ones each have their own.
    rank = 0 if name in TENSOR_STRATEGIES else dist.get_rank()
    loss_fn = net.__dict__.get("loss_fn", lm_loss)

    def step(i: int) -> float:
        x, y = synthetic_batch(setup.cfg, setup.batch, seed=1000 * rank + i)
        with in_block():  # DDP rebuilds its buckets in the second forward
            opt.zero_grad()
            loss = loss_fn(net(x).float(), y)
            _sample_memory()
            loss.backward()
            _sample_memory()
            opt.step()
        return loss.item()

    return net, step


def _allocations(kind: str) -> Callable[[], contextlib.AbstractContextManager]:
    """Where a strategy's step allocates: pycomm's arena for the -arena kinds."""
    if kind.endswith("-arena"):
        import pycomm

        return pycomm.use_arena
    return contextlib.nullcontext


def _timed_steps(step: Callable, first: int, count: int) -> list[float]:
    times = []
    for i in range(first, first + count):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return times


def time_strategies(names: list[str], setup: Setup) -> dict[str, dict[str, Any]]:
    """Median step time of each strategy, interleaved in rounds (rank-local figures)."""
    torch.set_num_threads(1)  # one core per rank, as torchrun would
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    built = {name: build(name, setup, groups) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, float] = {}
    for name in names:
        _timed_steps(built[name][1], 0, setup.warmup)
    for r in range(setup.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier(groups["gloo"])
            first = setup.warmup + r * setup.steps
            times[name] += _timed_steps(built[name][1], first, setup.steps)
    for name in names:
        losses[name] = built[name][1](10**6)  # one more step on a common batch
    return {
        name: {"median_s": statistics.median(t), "times_s": t, "loss": losses[name]}
        for name, t in times.items()
    }


def peak_memory(name: str, setup: Setup) -> dict[str, Any]:
    """Peak RSS of a fresh process running a few steps of one strategy, and the
    communication buffers the strategy itself reports."""
    torch.set_num_threads(1)
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    net, step = build(name, setup, groups)
    _PEAK_PSS[0] = 0
    for i in range(3):
        step(i)
    param_bytes = sum(local_numel(p) * p.element_size() for p in net.parameters())
    own = net.comm_stats()["reserved_bytes"] if isinstance(net, DataParallel) else None
    zero = getattr(net, "zero_optimizer", None)
    return {
        "zero_memory": zero.memory_stats() if zero is not None else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "pss_bytes": _pss_bytes(),
        "peak_pss_bytes": _PEAK_PSS[0],
        "param_bytes": param_bytes,
        "grad_arena_bytes": own,
    }


_PEAK_PSS = [-1]  # -1: not sampling (timed runs); otherwise the largest PSS seen


def _sample_memory() -> None:
    """PSS at the two memory peaks of a step: after forward (activations, and whatever
    parameters stay gathered) and after backward (gradients before the step)."""
    if _PEAK_PSS[0] >= 0:
        _PEAK_PSS[0] = max(_PEAK_PSS[0], _pss_bytes())


def _pss_bytes() -> int:
    """Proportional set size now: shared pages count 1/(processes mapping them). RSS
    counts a peer's shared-memory gradients, mapped for zero-copy reads, in full on every
    rank; PSS does not."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0
