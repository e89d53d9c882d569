"""A pipeline's forward alone (evaluation): every micro-batch through every stage, the
last stage's mean loss returned on every stage, nothing kept for a backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .microbatch import split_batch
from .p2p import recv_tensor, send_tensor
from .pipeline import Pipeline


@torch.no_grad()
def forward_loss(pipe: Pipeline, inputs: Any, targets: Any, loss_fn: Any,
                 loss_is_mean: bool = True) -> torch.Tensor:
    """The mean of ``loss_fn`` over the batch (weighted by micro-batch rows; summed as
    they are with ``loss_is_mean=False``), as :meth:`Pipeline.step` computes it, without
    gradients. Every stage passes its batch (the first stage's inputs and the last
    stage's targets are used)."""
    rows = inputs.shape[0]
    ins = split_batch(inputs, pipe.chunks)
    tgts = split_batch(targets, pipe.chunks)
    total = torch.zeros(1, dtype=torch.float64)
    sends = []
    for m in range(pipe.chunks):
        if tgts[m].shape[0] == 0:  # fewer rows than micro-batches: every stage skips it
            continue
        x = ins[m] if pipe.is_first else recv_tensor(pipe.stage_id - 1, pipe.group)
        pipe.entering(m)
        out = pipe.stage(x)
        if pipe.is_last:
            weight = tgts[m].shape[0] / rows if loss_is_mean else 1.0
            total += loss_fn(out, tgts[m]).double() * weight
        else:
            sends.append(send_tensor(out, pipe.stage_id + 1, pipe.group))
    for pending in sends:
        pending.wait()
    last = pipe.num_stages - 1
    src = dist.get_global_rank(pipe.group, last) if pipe.group is not None else last
    dist.broadcast(total, src=src, group=pipe.group)
    return total[0]
