"""Averaging gradients over the data-parallel group at one chosen moment.

:class:`DataParallel` reduces while backward runs, which needs to know which backward
is the last one; a composed job (a pipeline runs many backwards per step, tensor
parallelism sums partial gradients first) reduces once, when told, in the order the
job's :func:`pycomm.parallel.compose.finalize.finalize_grads` fixes. The gradients live in one
preallocated flat arena laid out by :class:`GradLayout`, as :class:`DataParallel`'s do
(C_B-sized buckets of it are all-reduced, each started before the next; shared memory
on pycomm, so the all-reduces are zero-copy): once attached, every ``.grad`` is a view
of it (torch's ``gradient_as_bucket_view``), so backward accumulates into it, the
average is taken in place, and no gradient exists twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pycomm.flat_arena import Arena

from .data_comms import averaging_op
from .grad_layout import GradLayout

MB = 1 << 20


class GradAverager:
    """Averages the gradients of ``params`` over ``group`` when called.

    Args:
        params: parameters of one dtype; a parameter without a gradient contributes zeros
            (and gets the average, as in one process over the whole batch).
        group: the data-parallel group.
        bucket_mb: bucket size (C_B).
        divide_by: the sum is divided by this instead of the group's size (experts'
            gradients summed over their expert-data-parallel group, each replica's being
            of the tokens of ``ep`` replicas, over all ``dp`` replicas).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_mb: float = 25, divide_by: int | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.world = group, dist.get_world_size(group)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"GradAverager: parameters must share one dtype, got {dtypes}")
        dtype = dtypes.pop() if dtypes else torch.float32
        self.op, self.divide_after = averaging_op(group)
        self.divisor = self.world
        if divide_by is not None and divide_by != self.world:
            self.op, self.divide_after, self.divisor = dist.ReduceOp.SUM, True, divide_by
        arena = Arena.for_group(GradLayout.arena_numel(self.params, dtype), dtype, group)
        cap = int(bucket_mb * MB)
        # Registration order, every bucket the same cap: reduced at one moment, not in
        # backward's order as DataParallel's are.
        layout = GradLayout(self.params, range(len(self.params)), arena, cap, cap)
        self.buffer, self.views, self.spans = arena.buffer, layout.views, layout.slices

    @torch.no_grad()
    def zero(self) -> None:
        """Zero every gradient, each ``.grad`` a view of the buffer from now on (the next
        backward accumulates into it)."""
        self.buffer.zero_()
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view

    @torch.no_grad()
    def __call__(self) -> None:
        self._gather_grads()
        if self.world == 1 and self.divisor == 1:
            return
        works = [dist.all_reduce(span, op=self.op, group=self.group, async_op=True)
                 for span in self.spans]
        for work in works:
            work.wait()
        if self.divide_after:
            self.buffer.div_(self.divisor)

    def _gather_grads(self) -> None:
        """Gradients that are not the buffer's views (set by someone else, or none) are
        copied in, and the views take their place."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
