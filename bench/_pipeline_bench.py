"""Rank side of ``bench.training pipeline``: torch.distributed.pipelining against
parallel.pipeline on one deep MLP, the bubble per stage, and activation memory."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.parallel.pipeline import ActivationMeter, Pipeline, idle_fractions, plot_timeline

BUBBLE_ROWS = 16
PIPE_STRATEGIES = [f"{impl}-{sched}-{group}" for group in ("pycomm", "gloo")
                   for impl in ("torch", "parallel.pipeline") for sched in ("gpipe", "1f1b")]


@dataclass
class PipeSetup:
    width: int
    layers: int  # Linear + GELU pairs
    rows: int  # mini-batch rows
    chunks: int
    steps: int
    rounds: int
    warmup: int


def mlp(setup: PipeSetup) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(setup.layers):
        layers += [nn.Linear(setup.width, setup.width), nn.GELU()]
    return nn.Sequential(*layers)


def _batch(setup: PipeSetup, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return (torch.randn(setup.rows, setup.width, generator=gen),
            torch.randn(setup.rows, setup.width, generator=gen))


def _even(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def build(name: str, setup: PipeSetup, groups: dict[str, Any], checkpoint: str = "never",
          input_grad: bool = False) -> tuple[Callable[[int], None], Any]:
    """One training step of strategy ``name`` (and its Pipeline, for ours). With
    ``input_grad`` the first stage also computes its input's gradient, as every other
    stage does, so equal layers make equal stages."""
    impl, sched, group_name = name.rsplit("-", 2)
    group = groups[group_name]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    net = mlp(setup)
    balance = _even(len(net), world)
    if impl == "torch":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        start = sum(balance[:rank])
        module = net[start : start + balance[rank]]
        stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        cls = ScheduleGPipe if sched == "gpipe" else Schedule1F1B
        schedule = cls(stage, setup.chunks, loss_fn=_loss)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)

        def torch_step(i: int) -> None:
            x, y = _batch(setup, i)
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()

        return torch_step, None
    pipe = Pipeline(net, balance, setup.chunks, checkpoint=checkpoint, schedule=sched,
                    process_group=group)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def our_step(i: int) -> None:
        x, y = _batch(setup, i)
        x.requires_grad_(input_grad)
        opt.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, _loss)
        opt.step()

    return our_step, pipe


def _groups() -> dict[str, Any]:
    return {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}


def time_pipelines(names: list[str], setup: PipeSetup) -> dict[str, list[float]]:
    """Step times per strategy (this rank), strategies interleaved in rounds."""
    torch.set_num_threads(1)
    groups = _groups()
    steps = {name: build(name, setup, groups)[0] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        for i in range(setup.warmup):
            steps[name](i)
    for r in range(setup.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier(groups["gloo"])
            for i in range(setup.steps):
                start = time.perf_counter()
                steps[name](100 + i)
                times[name].append(time.perf_counter() - start)
    return times


def peak_rss(name: str, setup: PipeSetup) -> int:
    torch.set_num_threads(1)
    step, _ = build(name, setup, _groups())
    for i in range(3):
        step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bubbles(setup: PipeSetup, micro: list[int], png: str | None) -> dict[int, dict[int, float]]:
    """Idle fraction per stage (GPipe, equal stages) for each M; rank 0 draws M = 4.
    Micro-batches have ``BUBBLE_ROWS`` rows whatever M, so a stage's time per micro-batch
    is the same at every M, as the formula assumes (with 4-row micro-batches the fixed
    cost per message and per step would be counted as bubble)."""
    torch.set_num_threads(1)
    out = {}
    for m in micro:
        pipe_setup = PipeSetup(**{**setup.__dict__, "chunks": m, "rows": BUBBLE_ROWS * m})
        step, pipe = build("parallel.pipeline-gpipe-pycomm", pipe_setup, {"pycomm": None},
                           input_grad=True)
        fractions = []
        for i in range(setup.warmup + 10):
            step(i)
            if i >= setup.warmup:
                fractions.append(idle_fractions(pipe.gather_trace()))
        out[m] = {s: statistics.median(f[s] for f in fractions) for s in fractions[0]}
        if m == 4:
            trace = pipe.gather_trace()  # collective: every rank
            if png and dist.get_rank() == 0:
                plot_timeline(trace, png, title=f"GPipe, K={pipe.num_stages}, M=4")
    return out


def activation_memory(setup: PipeSetup) -> dict[str, int]:
    """Peak bytes autograd holds on this stage during one step, per schedule and mode."""
    torch.set_num_threads(1)
    out = {}
    for sched in ("gpipe", "1f1b"):
        for mode in ("never", "except_last", "always"):
            step, pipe = build(f"parallel.pipeline-{sched}-pycomm", setup, {"pycomm": None},
                               checkpoint=mode)
            meter = ActivationMeter()
            with meter.measure(pipe.stage):
                step(0)
            out[f"{sched}/{mode}"] = meter.peak_bytes
    return out
