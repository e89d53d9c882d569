"""Constant-size buckets (ZeRO-R's C_B): many small tensors, one collective per bucket.

:func:`plan_buckets` groups consecutive items (gradients, in the order they become
ready) into buckets of at most ``cap_bytes``. :class:`Bucketer` counts items as they
become ready and launches each full bucket's collective at once, strictly in bucket
order, so every rank issues the same collectives in the same order however its items
arrive. What the collective is (all-reduce, reduce-scatter, ...) is the caller's
``launch`` function; the bucketer only orders, launches and waits.

Example::

    plan = plan_buckets([p.numel() * 4 for p in params_in_ready_order], 25 << 20, 1 << 20)
    bucketer = Bucketer(plan, launch=lambda k: dist.all_reduce(slices[k], async_op=True))
    ...  # autograd hooks call bucketer.mark_ready(i)
    bucketer.wait()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Waitable(Protocol):
    """What a launch returns: a ``torch.distributed`` Work (``async_op=True``)."""

    def wait(self) -> Any: ...


def plan_buckets(item_bytes: Sequence[int], cap_bytes: int,
                 first_cap_bytes: int | None = None) -> list[range]:
    """Consecutive groups of item indices, each at most ``cap_bytes`` in total.

    The first bucket is capped at ``first_cap_bytes`` instead (smaller, so the first
    collective starts early in backward, as DDP does). An item larger than the cap gets
    a bucket to itself. Empty buckets are never produced.

    Raises:
        ValueError: if a cap is not positive.
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if cap_bytes <= 0 or first <= 0:
        raise ValueError(f"plan_buckets: caps must be > 0 bytes, got {cap_bytes} and {first}")
    buckets: list[range] = []
    start, filled = 0, 0
    for i, nbytes in enumerate(item_bytes):
        cap = first if not buckets else cap_bytes
        if i > start and filled + nbytes > cap:
            buckets.append(range(start, i))
            start, filled = i, 0
        filled += nbytes
    if start < len(item_bytes):
        buckets.append(range(start, len(item_bytes)))
    return buckets


class Bucketer:
    """Launches each bucket's collective once all its items are ready, in bucket order.

    Args:
        plan: the item indices of each bucket, in bucket order (e.g. the ranges of
            :func:`plan_buckets`); every item in at most one bucket.
        launch: ``launch(bucket_index)`` starts that bucket's collective and returns its
            Work (anything with ``wait()``).

    Raises:
        RuntimeError: from :meth:`mark_ready` when an item is marked twice in one round,
            or is not in the plan.
    """

    def __init__(self, plan: Sequence[Sequence[int]], launch: Callable[[int], Waitable]):
        self.plan = [list(bucket) for bucket in plan]
        self._launch = launch
        self._bucket_of = {item: k for k, bucket in enumerate(self.plan) for item in bucket}
        self.collectives_issued = 0
        # ("launch" | "complete" | "done", bucket, perf_counter time): "complete" when the
        # collective finished, "done" when wait() returned for it.
        self.trace: list[tuple[str, int, float]] = []
        self.reset()

    def reset(self) -> None:
        """Start a new round: nothing ready, nothing launched (call after :meth:`wait`)."""
        self._missing = [len(b) for b in self.plan]
        self._ready: set[int] = set()
        self._next_launch = 0
        self._works: list[Waitable] = []
        self.trace = []

    @property
    def num_buckets(self) -> int:
        return len(self.plan)

    @property
    def launched(self) -> int:
        """Buckets launched so far this round."""
        return self._next_launch

    def is_ready(self, item: int) -> bool:
        return item in self._ready

    def mark_ready(self, item: int) -> None:
        """Count ``item`` in; launch every bucket that is now complete and next in order."""
        if item not in self._bucket_of:
            raise RuntimeError(f"Bucketer: item {item} is not in any bucket")
        if item in self._ready:
            raise RuntimeError(
                f"Bucketer: item {item} was marked ready twice in one round (bucket "
                f"{self._bucket_of[item]}); was backward run twice without a new forward?"
            )
        self._ready.add(item)
        self._missing[self._bucket_of[item]] -= 1
        self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        while self._next_launch < len(self.plan) and self._missing[self._next_launch] == 0:
            k = self._next_launch
            self.trace.append(("launch", k, time.perf_counter()))
            work = self._launch(k)
            self._record_completion(work, k)
            self._works.append(work)
            self.collectives_issued += 1
            self._next_launch += 1

    def _record_completion(self, work: Waitable, k: int) -> None:
        """Trace when the collective itself finishes (on the backend's thread), which
        shows whether buckets complete in launch order and before backward ends."""
        get_future = getattr(work, "get_future", None)
        if get_future is None:
            return
        try:
            future = get_future()
        except RuntimeError:  # some Work types (gloo's reduce-scatter) have no future
            return
        trace = self.trace  # this round's list, even if a new round starts meanwhile
        future.add_done_callback(lambda _: trace.append(("complete", k, time.perf_counter())))

    def missing_items(self) -> list[int]:
        """Items not marked ready this round, in plan order."""
        return [i for bucket in self.plan for i in bucket if i not in self._ready]

    def wait(self) -> None:
        """Wait for every launched bucket, in launch order.

        Raises:
            RuntimeError: if some buckets were never launched (items still missing).
        """
        if self._next_launch < len(self.plan):
            raise RuntimeError(
                f"Bucketer.wait: bucket {self._next_launch} of {len(self.plan)} was never "
                f"launched; items not ready: {self.missing_items()}"
            )
        for k, work in enumerate(self._works):
            work.wait()
            self.trace.append(("done", k, time.perf_counter()))
