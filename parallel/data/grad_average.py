"""Averaging gradients over the data-parallel group at one chosen moment.

:class:`DataParallel` reduces while backward runs, which needs to know which backward
is the last one; a composed job (a pipeline runs many backwards per step, tensor
parallelism sums partial gradients first) reduces once, when told, in the order the
job's :func:`parallel.compose.finalize.finalize_grads` fixes. The gradients go through one
preallocated flat buffer in constant-size buckets (C_B; shared memory on pycomm, so the
all-reduces are zero-copy), each bucket's all-reduce started before the next is packed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel.data.data_comms import averaging_op
from pycomm.flat_arena import Arena

MB = 1 << 20


class GradAverager:
    """Averages the gradients of ``params`` over ``group`` when called.

    Args:
        params: parameters of one dtype; a parameter without a gradient contributes zeros
            (and gets the average, as in one process over the whole batch).
        group: the data-parallel group.
        bucket_mb: bucket size (C_B).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_mb: float = 25):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.world = group, dist.get_world_size(group)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"GradAverager: parameters must share one dtype, got {dtypes}")
        dtype = dtypes.pop() if dtypes else torch.float32
        self.op, self.divide_after = averaging_op(group)
        numel = sum(p.numel() for p in self.params)
        self.buffer = Arena.for_group(numel, dtype, group).buffer[:numel]
        self.buckets = _buckets([p.numel() for p in self.params], int(bucket_mb * MB) //
                                max(1, dtype.itemsize))

    @torch.no_grad()
    def __call__(self) -> None:
        if self.world == 1:
            return
        works, offset, views = [], 0, []
        for first, last in self.buckets:
            start = offset
            for p in self.params[first:last]:
                view = self.buffer[offset : offset + p.numel()]
                view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
                views.append((p, view))
                offset += p.numel()
            works.append(dist.all_reduce(self.buffer[start:offset], op=self.op,
                                         group=self.group, async_op=True))
        for work in works:
            work.wait()
        if self.divide_after:
            self.buffer.div_(self.world)
        for p, view in views:
            if p.grad is None:
                p.grad = view.view_as(p).clone()
            else:
                p.grad.copy_(view.view_as(p))


def _buckets(numels: list[int], cap: int) -> list[tuple[int, int]]:
    """Consecutive parameter ranges of at most ``cap`` elements (one alone if larger)."""
    out, first, size = [], 0, 0
    for i, n in enumerate(numels):
        if size and size + n > cap:
            out.append((first, i))
            first, size = i, 0
        size += n
    if first < len(numels):
        out.append((first, len(numels)))
    return out
