"""ZeRO-2's gradients: a bucket is whole only while it is filled and reduce-scattered.

A stage-2 rank keeps ``1/world`` of the gradient, its shard of each bucket. A bucket's
whole gradient needs a buffer (C_B) only from its first gradient until its
reduce-scatter into the shard has finished, so the buffer, exactly the bucket's size, is
taken then and given back after: between steps a rank holds its shards and nothing else.
Buffers are taken in bucket order, at most ``window`` at once. Reducing in backward that
is two (backward fills one while the one before is reduce-scattered: the overlap);
reducing after the last backward (``reduce_gradients``) nothing can leave early, so every
bucket gets one as its gradients arrive, in place of the tensors autograd would allocate.

An arriving gradient moves into its bucket's buffer (its ``.grad`` becomes a view of it,
so later backwards accumulate there, as stage 1's do in its arena); when the window is
full of buckets still being filled it stays in ``.grad`` and is copied in when its bucket
gets a buffer. Under mixed precision with a wider reduce dtype it is cast into the buffer
and ``.grad`` is cleared.

Gradients accumulated over several backwards without ``zero_grad``: the rank's own part
of the buffer gets ``world`` times its current shard added before the reduce-scatter, so
the average lands in the shard as old + new, with no scratch shard.

The buffers are ordinary memory, not pycomm's shared arena: they are given back every
step and the arena never returns its slabs, while zero-copy gains little at bucket sizes
(reduce_scatter at 2 ranks on this project's VM: 41 vs 60 us at 1 MB, equal at 8 MB).
So no peer reads them in place either, and once its reduce-scatter has been waited for
a buffer's memory is freed at once, whoever still holds the tensor.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..grad_hooks import move_grad_into
from . import zero_comms as comms
from .shard_layout import ShardLayout


def window_numel(layout: ShardLayout, window: int) -> int:
    """The most elements ``window`` consecutive buckets' buffers hold at once."""
    sizes = [b.shard * layout.world for b in layout.buckets]
    return max((sum(sizes[k : k + window]) for k in range(len(sizes))), default=0)


class GradStream:
    """Bucket buffers taken on demand and reduce-scattered into ``shards``.

    Args:
        params: the parameters, in :class:`ShardLayout` index order.
        layout: their buckets; this rank's shard of bucket ``k`` is ``shards[k]``.
        shards: where each bucket's reduce-scatter lands (the reduced gradient).
        dtype: the reduce dtype (of ``shards`` and the buffers).
        op, group: the averaging reduction and the data-parallel group.
        window: the most buffers live at once.
    """

    def __init__(self, params: list[nn.Parameter], layout: ShardLayout,
                 shards: list[torch.Tensor], dtype: torch.dtype, op: Any,
                 group: dist.ProcessGroup | None, window: int):
        self.params, self.layout, self.shards = params, layout, shards
        self.dtype, self.op, self.group, self.window = dtype, op, group, window
        self._bucket_of = layout.bucket_of_param()
        self._buffers: dict[int, torch.Tensor] = {}
        self._works: deque[tuple[int, Any]] = deque()  # launched, not yet waited for
        self._next = 0  # the next bucket to get a buffer this round
        self._moved: set[int] = set()  # parameters whose gradient is in a buffer
        self.live_bytes = self.peak_bytes = 0

    # -- buffers -------------------------------------------------------------------------------

    def _view(self, i: int) -> torch.Tensor:
        bucket = self.layout.buckets[self._bucket_of[i]]
        start = self.layout.offsets[i] - bucket.start
        shape = self.params[i].shape
        return self._buffers[self._bucket_of[i]][start : start + shape.numel()].view(shape)

    def _take_through(self, k: int) -> bool:
        """Give buckets up to ``k`` their buffers, in order and within the window (waiting
        for the oldest reduce-scatter if need be); False if the window is full of buckets
        not launched yet."""
        while self._next <= k:
            if len(self._buffers) >= self.window and not self._retire_oldest():
                return False
            bucket = self.layout.buckets[self._next]
            buffer = torch.empty(bucket.shard * self.layout.world, dtype=self.dtype)
            self._buffers[self._next] = buffer
            self._next += 1
            self.live_bytes += buffer.numel() * buffer.element_size()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return True

    def _retire_oldest(self) -> bool:
        """Wait for the oldest reduce-scatter and give its buffer back (buffers are taken
        and launched in bucket order, so it holds the oldest live buffer)."""
        if not self._works:
            return False
        k, work = self._works.popleft()
        work.wait()
        buffer = self._buffers.pop(k)
        self.live_bytes -= buffer.numel() * buffer.element_size()
        # Free it now: pycomm keeps a finished op's tensors until the caller's next op
        # (to drop them on this thread), which may be the next step's first.
        buffer.untyped_storage().resize_(0)
        return True

    # -- a round -------------------------------------------------------------------------------

    def on_grad(self, i: int, param: torch.Tensor, as_view: bool) -> None:
        """Autograd accumulated ``param``'s gradient: move it into its bucket's buffer if
        the bucket has (or can get) one; ``as_view``: ``.grad`` becomes the buffer's view."""
        k = self._bucket_of[i]
        if k not in self._buffers and not (k >= self._next and self._take_through(k)):
            return  # copied in when the bucket gets its buffer
        view = self._view(i)
        if as_view:
            move_grad_into(param, view)  # later backwards accumulate in place
        elif param.grad is not None:
            view.copy_(param.grad)
            param.grad = None
        self._moved.add(i)

    def launch(self, k: int, accumulate: bool) -> Any:
        """Reduce-scatter bucket ``k`` (every bucket before it launched) into its shard;
        ``accumulate``: add to the shard instead of replacing it."""
        if not self._take_through(k):
            raise RuntimeError(f"ZeroOptimizer: bucket {k} has no buffer at its launch")
        bucket, buffer = self.layout.buckets[k], self._buffers[k]
        buffer[self._fill(k) :].zero_()  # the padding
        if accumulate:
            own = buffer[self.layout.rank * bucket.shard : (self.layout.rank + 1) * bucket.shard]
            own.add_(self.shards[k], alpha=self.layout.world)
        work = comms.reduce_scatter_bucket(self.shards[k], buffer, self.op, self.group)
        self._works.append((k, work))
        return work

    def _fill(self, k: int) -> int:
        """Bring bucket ``k``'s gradients still elsewhere into its buffer (a parameter
        without one contributes zeros) and clear their ``.grad``; returns the elements
        used."""
        used = 0
        for i in self.layout.buckets[k].params:
            p, view = self.params[i], self._view(i)
            grad = p.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                view.copy_(grad)  # not moved on arrival, or replaced since
            elif grad is None and i not in self._moved:
                view.zero_()
            p.grad = None  # the whole gradient is not kept (stage 2)
            used = max(used, self.layout.offsets[i] - self.layout.buckets[k].start + p.numel())
        return used

    def finish(self) -> None:
        """The round's end: wait for every reduce-scatter, give every buffer back."""
        while self._works:
            self._retire_oldest()
        self.discard()

    def discard(self) -> None:
        """Give back every buffer (``zero_grad`` before a reduction drops what they hold)."""
        while self._works:
            self._retire_oldest()
        for k in self._buffers:
            for i in self.layout.buckets[k].params:
                grad = self.params[i].grad
                if grad is not None and grad.data_ptr() == self._view(i).data_ptr():
                    self.params[i].grad = None
        self._buffers.clear()
        self._moved.clear()
        self._next, self.live_bytes = 0, 0
