"""Stage 3's gradient side: each unit's gradients reduce-scattered into this rank's shard.

As a gradient is accumulated, it is copied into its unit's whole-unit gradient buffer
(from the :class:`SlotPool`) and dropped; once every parameter of the unit has its
gradient, the gathered parameters are freed and (through the :class:`Bucketer`, so every
rank issues the same collectives in the same order) the buffer is reduce-scattered
straight into the gradient of this rank's shard. At most ``MAX_IN_FLIGHT``
buffers are being reduced at once; a rank holds ``1/world`` of the gradients plus
those. Where each reduced shard goes is the sink the shards' home chose
(:mod:`pycomm.parallel.zero.grad_sinks`): the shard gradients in memory, or offloaded, the
unit's optimizer step as soon as its reduce-scatter is done.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pycomm.bucketer import Bucketer
from pycomm.flat_arena import Arena

from ..grad_hooks import EndOfBackward, on_grad_ready
from . import zero_comms as comms
from .grad_sinks import GradSink
from .shard_layout import ShardLayout
from .slot_pool import SlotPool
from .units import Unit

MAX_IN_FLIGHT = 2


class UnitHost(Protocol):
    """What the reducer uses of the sharded model that owns it (``ShardedModel``): its
    units and their buffers, and when it may free a unit's gathered parameters."""

    group: dist.ProcessGroup | None
    world: int
    dtype: torch.dtype
    layout: ShardLayout
    params: list[nn.Parameter]
    units: list[Unit]
    unit_of: dict[int, Unit]
    pool: SlotPool
    home: Any  # the shards' home (zero.shard_homes): it picks the gradients' sink

    def backward_unit_order(self) -> list[int]: ...

    def shard_views(self, arena: Arena) -> list[torch.Tensor]: ...

    def release(self, u: Unit) -> None: ...

    def release_all(self) -> None: ...


class UnitGradReducer:
    """Owns the reduced gradient shards (``shard_grads``, in the reduce dtype) and fills
    them every backward; the optimizer steps on them (see ``step_on_masters``)."""

    def __init__(self, engine: UnitHost):
        self.engine = engine
        self.set_reduce_dtype(engine.dtype)
        self._op, self._divide_after = comms.averaging_op(engine.group)
        self._bucketer: Bucketer | None = None
        self._plan: list[Unit] = []
        self._slots: dict[int, torch.Tensor] = {}  # unit index -> its gradient buffer
        self._got = [False] * len(engine.params)
        self._seen = [0] * len(engine.units)
        self._in_flight: deque[tuple[Any, torch.Tensor, Unit, torch.Tensor]] = deque()
        self.fresh = True  # the next backward overwrites the master gradients
        self._end = EndOfBackward(self._finalize)
        on_grad_ready(engine.params, self._on_grad)

    def set_reduce_dtype(self, dtype: torch.dtype) -> None:
        """Reduce in ``dtype``; the reduced shards (``shard_grads``, one per unit) too."""
        self.reduce_dtype = dtype
        self.sink: GradSink = self.engine.home.grad_sink(dtype, self.engine.shard_views)

    @property
    def grads(self) -> Arena | None:
        """The reduced shard gradients' arena (None offloaded: none is kept)."""
        return self.sink.grads

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """Each unit's reduced shard gradient ([] offloaded)."""
        return self.sink.shard_grads

    def begin_backward(self) -> None:
        if self._bucketer is None:
            self._plan = [self.engine.units[k] for k in self.engine.backward_unit_order()]
            self._bucketer = Bucketer([u.ids for u in self._plan], self._launch)
        self._end.request()

    # -- per parameter ---------------------------------------------------------------------------

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        u = self.engine.unit_of[i]
        grad = param.grad
        if grad is None or self._bucketer is None:
            return
        u.piece(self._slot(u), u.position[i]).copy_(grad.reshape(-1))
        param.grad = None  # the whole gradient is not kept
        self._got[i] = True
        self._seen[u.index] += 1
        if self._seen[u.index] == len(u.ids) and not u.persistent:
            self.engine.release(u)  # its parameters are not needed again this step
        self._bucketer.mark_ready(i)

    def _slot(self, u: Unit) -> torch.Tensor:
        if u.index not in self._slots:
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self._recycle_oldest()
            self._slots[u.index] = self.engine.pool.take(u.full_numel, self.reduce_dtype)
        return self._slots[u.index]

    def _recycle_oldest(self) -> None:
        work, slot, u, out = self._in_flight.popleft()
        work.wait()
        self.engine.pool.give(slot)
        self.sink.arrived(u, out, self._divisor())

    # -- per unit --------------------------------------------------------------------------------

    def _launch(self, k: int) -> Any:
        u = self._plan[k]
        slot = self._slot(u)
        for j, i in enumerate(u.ids):  # no gradient this backward: it contributes zeros
            if not self._got[i]:
                u.piece(slot, j).zero_()
        slot[u.offsets[-1] + u.shapes[-1].numel():].zero_()  # the padding
        out = self.sink.destination(u, self.fresh)
        work = comms.reduce_scatter_bucket(out, slot, self._op, self.engine.group)
        del self._slots[u.index]
        self._in_flight.append((work, slot, u, out))
        return work

    def _divisor(self) -> int:
        """What a reduced gradient is divided by: the world where the backend has no
        AVG (the sum was taken), else 1."""
        return self.engine.world if self._divide_after else 1

    def _finalize(self) -> None:
        assert self._bucketer is not None
        for i in self._bucketer.missing_items():
            self._bucketer.mark_ready(i)
        self._bucketer.wait()
        self._bucketer.reset()
        while self._in_flight:
            self._recycle_oldest()
        self.engine.release_all()
        accumulates = self.sink.finish(self.fresh, self._divisor())
        self._got = [False] * len(self._got)
        self._seen = [0] * len(self._seen)
        self.fresh = not accumulates

    def zero_grad(self) -> None:
        self.sink.zero()
        self.fresh = True
