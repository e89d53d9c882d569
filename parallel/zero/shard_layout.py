"""How ZeRO stages 1 and 2 lay parameters out: flat buckets, each split into equal shards.

Parameters are grouped into buckets (C_B, in the order their gradients become ready).
Bucket k is one contiguous range of a flat buffer, padded to ``world * shard_k``
elements; rank r owns ``[start_k + r * shard_k, start_k + (r + 1) * shard_k)`` of it.
So one reduce-scatter of a bucket hands each rank exactly the gradient of its shard,
and one all-gather of a bucket (every rank contributing its shard in place) rebuilds
the bucket's parameters. A rank's shards of all buckets together are its ``1/world``
of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pycomm.bucketer import plan_buckets
from pycomm.flat_arena import aligned_numel


@dataclass(frozen=True)
class BucketSpan:
    """Bucket ``k``: its parameter indices, its flat range and each rank's shard size."""

    params: tuple[int, ...]
    start: int  # first element in the flat buffer
    shard: int  # elements per rank (aligned); the bucket spans world * shard elements

    def full(self, world: int) -> slice:
        return slice(self.start, self.start + world * self.shard)

    def shard_of(self, rank: int) -> slice:
        return slice(self.start + rank * self.shard, self.start + (rank + 1) * self.shard)


class ShardLayout:
    """Parameter offsets in the flat buffer, bucket spans, and this rank's shard offsets.

    Args:
        params: the parameters (registration order).
        world, rank: the sharding group's size and this rank's place in it.
        cap_bytes: bucket cap; the first bucket is capped like the others.
        dtype: element type of the flat buffer.
    """

    def __init__(self, params: Sequence[nn.Parameter], world: int, rank: int, cap_bytes: int,
                 dtype: torch.dtype):
        order = list(reversed(range(len(params))))  # gradients arrive last layer first
        sizes = [params[i].numel() * dtype.itemsize for i in order]
        groups = [[order[j] for j in positions] for positions in plan_buckets(sizes, cap_bytes)]
        self._place([p.numel() for p in params], groups, world, rank, dtype)

    @classmethod
    def from_groups(cls, numels: Sequence[int], groups: Sequence[Sequence[int]], world: int,
                    rank: int, dtype: torch.dtype) -> ShardLayout:
        """One bucket per group of parameter indices, in the order given (stage 3: one
        bucket per sharded unit)."""
        layout = cls.__new__(cls)
        layout._place(list(numels), groups, world, rank, dtype)
        return layout

    def _place(self, numels: list[int], groups: Sequence[Sequence[int]], world: int, rank: int,
               dtype: torch.dtype) -> None:
        self.world, self.rank, self.dtype = world, rank, dtype
        self.numels = numels
        self.offsets = [0] * len(numels)
        self.buckets: list[BucketSpan] = []
        start = 0
        for group in groups:
            members = tuple(group)
            offset = start
            for i in members:
                self.offsets[i] = offset
                offset += numels[i]
            shard = aligned_numel(-(-(offset - start) // world), dtype)
            self.buckets.append(BucketSpan(members, start, shard))
            start += world * shard
        self.numel = start
        self.shard_numel = sum(b.shard for b in self.buckets)

    def local_offsets(self) -> list[int]:
        """Where each bucket's shard starts in this rank's contiguous shard buffer."""
        out, offset = [], 0
        for b in self.buckets:
            out.append(offset)
            offset += b.shard
        return out

    def bucket_of_param(self) -> dict[int, int]:
        return {i: k for k, b in enumerate(self.buckets) for i in b.params}
