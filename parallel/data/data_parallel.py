"""Data parallelism with constant-size gradient buckets (C_B) on one gradient arena (M_D).

Every parameter's ``.grad`` is a view into one preallocated, contiguous gradient arena
laid out in bucket order. An autograd hook per parameter marks its gradient ready; when
a bucket (a contiguous slice of the arena) is complete, its all-reduce starts at once,
while backward goes on computing earlier layers. Backward ends by waiting only for the
buckets still in flight. Averaging is fused into the collective (``AVG``) where the
backend has it. On a ``pycomm`` group the arena is shared memory, so each bucket's
all-reduce reads the peers' gradients in place (zero-copy).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.bucketer import Bucketer
from pycomm.flat_arena import Arena

from ..grad_hooks import EndOfBackward, move_grad_into, on_grad_ready
from . import data_comms as comms
from .grad_layout import GradLayout
from .unused import names_of, reachable_params

MB = 1 << 20


class DataParallel(nn.Module):
    """Wrap ``module`` so that backward averages its gradients across ``process_group``.

    Args:
        module: the model; every rank must wrap the same architecture. Its parameters
            are overwritten with rank 0's at wrap time.
        process_group: the group to average over (None: the default group). Any
            backend works; on ``pycomm`` the gradient all-reduces are zero-copy.
        bucket_cap_mb: bucket size cap in MiB (C_B).
        first_bucket_mb: cap of the first bucket, smaller so communication starts early.
        find_unused_parameters: allow parameters that get no gradient in a backward
            (found by walking the autograd graph after forward); without it, such
            parameters are an error naming them.
        broadcast_buffers: broadcast rank 0's module buffers before every forward.

    Raises:
        ValueError: at wrap time, if ranks' parameters differ or dtypes are mixed.
        RuntimeError: at the end of backward, naming parameters that received no
            gradient (without ``find_unused_parameters``).

    Example::

        model = DataParallel(model, process_group=group, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()     # gradients averaged when this returns
        optimizer.step()
        with model.no_sync():               # accumulate locally, sync on a later backward
            loss_fn(model(x2), y2).backward()
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._caps = (int(bucket_cap_mb * MB), int(first_bucket_mb * MB))
        self._op, self._divide_after = comms.averaging_op(process_group)
        self.arena = self._make_arena()
        comms.verify_same_params(self._names, self._params, process_group)
        comms.broadcast_through(self.arena.buffer, self._params, process_group)
        self._layout = self._new_layout(list(reversed(range(len(self._params)))))
        self._require_sync = True
        self._sync_pending = False
        self._end_of_backward = EndOfBackward(self._finalize)
        self._observed_order: list[int] | None = []  # first synced backward's ready order
        self._rebuild_pending = False
        self._touched = [False] * len(self._params)
        self._events: list[tuple[str, int, float]] = []
        on_grad_ready(self._params, self._on_grad_ready)

    # -- setup ---------------------------------------------------------------------------

    def _make_arena(self) -> Arena:
        dtypes = {p.dtype for p in self._params}
        devices = {p.device for p in self._params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"DataParallel: parameters must share one dtype and device, got dtypes "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        dtype = dtypes.pop() if dtypes else torch.float32
        device = devices.pop() if devices else torch.device("cpu")
        numel = GradLayout.arena_numel(self._params, dtype)
        return Arena.for_group(numel, dtype, self.group, device)

    def _new_layout(self, order: list[int]) -> GradLayout:
        layout = GradLayout(self._params, order, self.arena, *self._caps)
        previous: Bucketer | None = getattr(self, "_bucketer", None)
        issued = previous.collectives_issued if previous is not None else 0
        self._bucketer = Bucketer(layout.buckets, self._launch)
        self._bucketer.collectives_issued = issued
        return layout

    def _launch(self, bucket: int) -> Any:
        return dist.all_reduce(self._layout.slices[bucket], op=self._op, group=self.group,
                               async_op=True)

    def _is_home(self, i: int) -> bool:
        """Whether parameter i's ``.grad`` is its arena view (holding its gradient)."""
        grad = self._params[i].grad
        return grad is not None and grad.data_ptr() == self._layout.views[i].data_ptr()

    def _forget_stale_grads(self) -> None:
        """A parameter whose ``.grad`` was set to None has no gradient in its view yet."""
        for i in range(len(self._params)):
            if not self._is_home(i):
                self._touched[i] = False

    def _zero_if_absent(self, i: int) -> None:
        """Parameter i takes part in a bucket without a gradient: it contributes zeros."""
        if not self._is_home(i):
            self._layout.views[i].zero_()

    # -- forward ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._rebuild_pending:
            self._rebuild_buckets()
        if self.broadcast_buffers and self.world_size > 1:
            comms.broadcast_buffers(self.module, self.group)
        self._forget_stale_grads()
        self._bucketer.reset()
        self._events = []
        self._end_of_backward.reset()
        self._sync_pending = self._require_sync and torch.is_grad_enabled()
        output = self.module(*args, **kwargs)
        if self._sync_pending and self.find_unused_parameters:
            used = reachable_params(output, self._params)
            for i in range(len(self._params)):
                if i not in used:
                    self._zero_if_absent(i)
                    self._bucketer.mark_ready(i)
        return output

    def prepare_for_backward(self, sync: bool) -> None:
        """For a driver that runs several backwards per step (a pipeline runs one per
        micro-batch, its forwards and backwards interleaved): whether the coming backward
        averages the gradients (the step's last) or only accumulates them. Decided here,
        not at forward, because under a pipeline schedule the forward that ran last is not
        the one whose backward comes last.

        Raises:
            ValueError: with ``find_unused_parameters``, whose graph walk happens at forward.
        """
        if self.find_unused_parameters:
            raise ValueError("DataParallel: find_unused_parameters=True cannot be driven "
                             "backward by backward (inside a Pipeline); every parameter "
                             "must get a gradient")
        self._bucketer.reset()
        self._events = []
        self._end_of_backward.reset()
        self._sync_pending = sync and self._require_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first backward after
        it (of a forward run outside) averages the accumulated sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- backward ------------------------------------------------------------------------

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        # A fresh gradient (``.grad`` was None) moves into the arena. Copying is cheaper
        # than keeping zeroed views attached (a memset, then an add), and autograd
        # allocated this tensor either way. Later backwards accumulate in place.
        move_grad_into(param, self._layout.views[i])
        self._touched[i] = True
        if not self._sync_pending:
            return
        self._events.append(("ready", i, time.perf_counter()))
        self._end_of_backward.request()
        if self._observed_order is not None:
            self._observed_order.append(i)
        if not self._bucketer.is_ready(i):  # find_unused may have marked it already
            self._bucketer.mark_ready(i)

    def _finalize(self) -> None:
        """End of backward: launch what is left, wait for every bucket, then tidy up."""
        self._events.append(("backward_end", -1, time.perf_counter()))
        self._sync_pending = False
        missing = self._bucketer.missing_items()
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"DataParallel: these parameters received no gradient in backward: "
                f"{names_of(missing, self._names)}. Make every parameter take part in the "
                "loss, or wrap with find_unused_parameters=True"
            )
        for i in missing:
            self._zero_if_absent(i)
            self._bucketer.mark_ready(i)
        self._bucketer.wait()
        if self._divide_after:
            self.arena.buffer.div_(self.world_size)
        for i, p in enumerate(self._params):  # unused here: the view holds the others' average
            if not self._is_home(i):
                p.grad = self._layout.views[i]
        if self.find_unused_parameters:
            for i in comms.globally_unused(self._touched, self.group):
                self._params[i].grad = None  # as in one process: no gradient, not zero
        if self._observed_order is not None:
            self._rebuild_pending = True

    def _rebuild_buckets(self) -> None:
        """Once, after the first synced step: lay the arena out in the ready order rank 0
        observed, so buckets fill in the order backward really produces gradients."""
        self._rebuild_pending = False
        observed = self._observed_order or []
        self._observed_order = None
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        order = comms.broadcast_order(order, self.group)
        if order == self._layout.order:
            return
        # Keep the values of gradients still attached (accumulating across the rebuild);
        # after zero_grad(set_to_none=True), the usual case, there is nothing to copy.
        kept = {i: p.grad.clone() for i, p in enumerate(self._params) if p.grad is not None}
        self._layout = self._new_layout(order)
        self.arena.buffer.zero_()
        for i, value in kept.items():
            self._layout.views[i].copy_(value)
            self._params[i].grad = self._layout.views[i]

    # -- reporting -----------------------------------------------------------------------

    @property
    def trace(self) -> list[tuple[str, int, float]]:
        """Events of the last forward/backward, in time order: ("ready", param index),
        ("launch" | "complete" | "done", bucket index) and ("backward_end", -1), each
        with its ``time.perf_counter()``. "complete" is when the backend finished the
        collective (it may come before backward ends: that is the overlap)."""
        return sorted(self._events + self._bucketer.trace, key=lambda event: event[2])

    def comm_stats(self) -> dict[str, Any]:
        """Arena bytes (reserved, live, peak), buckets and their bytes, collectives issued."""
        return {
            **self.arena.stats(),
            "shared": self.arena.shared,
            "buckets": self._bucketer.num_buckets,
            "bucket_bytes": self._layout.bucket_bytes(),
            "params_per_bucket": [len(b) for b in self._layout.buckets],
            "collectives_issued": self._bucketer.collectives_issued,
        }

    def bucket_param_names(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in bucket order."""
        return [[self._names[i] for i in bucket] for bucket in self._layout.buckets]
