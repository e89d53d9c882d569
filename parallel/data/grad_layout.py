"""Where each gradient lives in the gradient arena, and which slice is which bucket.

Gradients are laid out in bucket order (the order they become ready in backward), so
a bucket is one contiguous slice of the arena and its all-reduce needs no packing copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pycomm.bucketer import plan_buckets
from pycomm.flat_arena import Arena, aligned_numel


class GradLayout:
    """Gradient views of ``params`` in ``arena``, placed in ``order``, and their buckets.

    Args:
        params: the parameters, indexed by registration order.
        order: parameter indices in bucket order (first to become ready first).
        arena: sized with :meth:`arena_numel`; the layout starts at its beginning.
        cap_bytes, first_cap_bytes: bucket caps (see :func:`pycomm.plan_buckets`).
    """

    def __init__(self, params: Sequence[nn.Parameter], order: Sequence[int], arena: Arena,
                 cap_bytes: int, first_cap_bytes: int):
        if sorted(order) != list(range(len(params))):
            raise ValueError(f"GradLayout: order must be a permutation of 0..{len(params) - 1}")
        self.order = list(order)
        arena.reset()
        self.views = [torch.empty(0)] * len(params)
        for i in self.order:
            self.views[i] = arena.allocate(params[i].numel()).view_as(params[i])
        itemsize = arena.dtype.itemsize
        sizes = [aligned_numel(params[i].numel(), arena.dtype) * itemsize for i in self.order]
        # Items of the plan are positions in ``order``; translate to parameter indices.
        plan = plan_buckets(sizes, cap_bytes, first_cap_bytes)
        self.buckets = [[self.order[j] for j in positions] for positions in plan]
        self.slices = [self._span(arena, bucket) for bucket in self.buckets]

    @staticmethod
    def arena_numel(params: Sequence[nn.Parameter], dtype: torch.dtype) -> int:
        """Elements an arena needs for every gradient, in any order, with alignment."""
        return sum(aligned_numel(p.numel(), dtype) for p in params)

    def _span(self, arena: Arena, bucket: list[int]) -> torch.Tensor:
        """The arena slice from the bucket's first view to its last (padding included)."""
        start = arena.offset_of(self.views[bucket[0]])
        last = self.views[bucket[-1]]
        end = arena.offset_of(last) + aligned_numel(last.numel(), arena.dtype)
        return arena.buffer[start : min(end, arena.capacity)]

    def bucket_of_param(self) -> dict[int, int]:
        """Parameter index -> bucket index."""
        return {i: k for k, bucket in enumerate(self.buckets) for i in bucket}

    def bucket_bytes(self) -> list[int]:
        return [s.numel() * s.element_size() for s in self.slices]
