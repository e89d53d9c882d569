"""Rank side of tests/test_use_arena.py: unchanged DDP training inside ``pycomm.use_arena``
on models pycomm did not write (torch's MLP and transformer encoder layer) and on its
own GPT, with the path of every gradient all-reduce read from pycomm's TRACE log.

``who`` says which ranks open the block: "all" (every bucket is in the arena on every
rank, so DDP's all-reduces are zero-copy) or "rank0" (only rank 0's are: all ranks must
take the streamed fallback together, with the same results).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import _dp_scenarios as gpt_case
import _interop_models as im
import torch
import torch.distributed as dist
from _zero_copy_scenarios import LogTap, _groups
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm.parallel.models import lm_loss

# Small enough that the tiny models fill several buckets, each above the direct size
# (4 KiB) so that each all-reduce takes zero-copy or its fallback.
BUCKET_CAP_MB = {"mlp": 0.006, "transformer": 0.006, "gpt": 0.02}
MIN_BYTES = 4096  # route the buckets of the tiny models (pycomm's default is 1 MiB)
DIRECT_BYTES = 4096
LINE = re.compile(r"seq \d+ (\w+) (\w+)\[(\d+)\][^:]*: (.*)$")


def _net(model: str) -> nn.Module:
    return gpt_case.model() if model == "gpt" else im.MODELS[model]()


def _loss(model: str, net: nn.Module, step: int, world: int, rank: int) -> torch.Tensor:
    if model == "gpt":
        x, y = gpt_case.batch(step, world, rank)
        return lm_loss(net(x), y)
    x, y = im.global_batch(step, world, model)
    return nn.functional.mse_loss(net(im.rank_slice(x, rank)), im.rank_slice(y, rank))


def _paths(log: str, ops: tuple[str, ...]) -> list[tuple[int, str]]:
    """(bytes, path) of each of ``ops`` this rank logged."""
    out = []
    for line in log.splitlines():
        m = LINE.search(line)
        if m and m.group(1) in ops:
            itemsize = torch.empty(0, dtype=getattr(torch, m.group(2))).element_size()
            out.append((int(m.group(3)) * itemsize, m.group(4)))
    return out


def train(model: str, who: str) -> dict[str, Any]:
    """SGD steps of DDP (gradients as bucket views) on ``model``, with the optimizer and
    step count of the single-process reference the test compares with."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _groups()[tuple(range(world))]
    routed = who == "all" or rank == 0
    net = _net(model)
    with torch.no_grad():  # replicas differ until DDP's first broadcast
        for p in net.parameters():
            p.add_(float(rank))
    gpt = model == "gpt"
    optimizer = (gpt_case.make_optimizer if gpt else im.make_optimizer)(net.parameters(), "sgd")
    losses = []
    with LogTap() as tap:
        with pycomm.use_arena(MIN_BYTES) if routed else contextlib.nullcontext():
            ddp = DDP(net, process_group=group, bucket_cap_mb=BUCKET_CAP_MB[model],
                      gradient_as_bucket_view=True)
            for step in range(gpt_case.STEPS if gpt else im.STEPS):
                loss = _loss(model, ddp, step, world, rank)
                loss.backward()
                losses.append(loss.item())
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)  # views of the buckets stay
        log = tap.take()
    return {"params": im.params_of(net), "losses": losses,
            "paths": [p for n, p in _paths(log, ("all_reduce",)) if n > DIRECT_BYTES],
            "grads_in_arena": [pycomm.in_arena(p.grad) for p in net.parameters()]}



def train_fsdp2(model: str, who: str) -> dict[str, Any]:
    """Optimizer steps of FSDP2 (``fully_shard`` per layer or block, then the root) on
    ``model``, with every allocation of 64 bytes or more in the arena where routed."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    group = _groups()[tuple(range(world))]
    gpt = model == "gpt"
    with LogTap() as tap:
        with pycomm.use_arena(64) if who == "all" or rank == 0 else contextlib.nullcontext():
            net = _net(model)
            mesh = DeviceMesh.from_group(group, "cpu")
            parts = net.blocks if gpt else [m for m in net if isinstance(m, nn.Linear)]
            for part in parts:
                fully_shard(part, mesh=mesh)
            fully_shard(net, mesh=mesh)
            # SGD on the GPT: Adam's normalised steps magnify reduction-order rounding
            # in its near-zero gradients beyond the reference's tolerance (the same with
            # or without the arena)
            optimizer = (gpt_case.make_optimizer(net.parameters(), "sgd") if gpt
                         else im.make_optimizer(net.parameters(), "adam"))
            losses = []
            for step in range(gpt_case.STEPS if gpt else im.STEPS):
                loss = _loss(model, net, step, world, rank)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            full = [p.full_tensor().detach().clone() for p in net.parameters()]
        log = tap.take()
    ops = ("all_gather", "reduce_scatter")
    return {"params": full, "losses": losses,
            "paths": [p for n, p in _paths(log, ops) if n > DIRECT_BYTES]}
