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
from parallel.models import lm_loss

# Small enough that the tiny models fill several buckets, each above the direct size
# (4 KiB) so that each all-reduce takes zero-copy or its fallback.
BUCKET_CAP_MB = {"mlp": 0.006, "transformer": 0.006, "gpt": 0.02}
MIN_BYTES = 4096  # route the buckets of the tiny models (pycomm's default is 1 MiB)
DIRECT_BYTES = 4096
LINE = re.compile(r"all_reduce (\w+)\[(\d+)\] \w+: (.*)$")


def _net(model: str) -> nn.Module:
    return gpt_case.model() if model == "gpt" else im.MODELS[model]()


def _loss(model: str, net: nn.Module, step: int, world: int, rank: int) -> torch.Tensor:
    if model == "gpt":
        x, y = gpt_case.batch(step, world, rank)
        return lm_loss(net(x), y)
    x, y = im.global_batch(step, world, model)
    return nn.functional.mse_loss(net(im.rank_slice(x, rank)), im.rank_slice(y, rank))


def _paths(log: str) -> list[tuple[int, str]]:
    """(bytes, path) of each all_reduce this rank logged."""
    out = []
    for line in log.splitlines():
        m = LINE.search(line)
        if m:
            itemsize = torch.empty(0, dtype=getattr(torch, m.group(1))).element_size()
            out.append((int(m.group(2)) * itemsize, m.group(3)))
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
            "paths": [p for n, p in _paths(log) if n > DIRECT_BYTES],
            "grads_in_arena": [pycomm.in_arena(p.grad) for p in net.parameters()]}

