"""Stage 3's gradient side: each unit's gradients reduce-scattered into this rank's shard.

As a gradient is accumulated, it is copied into its unit's whole-unit gradient buffer
(from the :class:`SlotPool`) and dropped; once every parameter of the unit has its
gradient, the gathered parameters are freed and (through the :class:`Bucketer`, so every
rank issues the same collectives in the same order) the buffer is reduce-scattered
straight into the gradient of this rank's shard. At most ``MAX_IN_FLIGHT``
buffers are being reduced at once; a rank holds ``1/world`` of the gradients plus
those. Offloaded (:mod:`pycomm.parallel.zero.offload`), a unit's shard lands in a buffer of its
own and is handed to the unit's optimizer step as soon as its reduce-scatter is done;
the rank then holds no gradient between units.
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
    offload: Any

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
        self._landed: list[tuple[Unit, torch.Tensor]] = []  # reduced outside the master grads
        self._scratch: Arena | None = None
        self.fresh = True  # the next backward overwrites the master gradients
        self._end = EndOfBackward(self._finalize)
        on_grad_ready(engine.params, self._on_grad)

    def set_reduce_dtype(self, dtype: torch.dtype) -> None:
        """Reduce in ``dtype``; the reduced shards (``shard_grads``, one per unit) too."""
        self.reduce_dtype = dtype
        if self.engine.offload is not None:  # each unit's shard exists only for its step
            self.grads: Arena | None = None
            self.shard_grads: list[torch.Tensor] = []
            return
        self.grads = Arena(self.engine.layout.shard_numel, dtype)
        self.shard_grads = self.engine.shard_views(self.grads)

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
        if self.engine.offload is not None:
            divide = self.engine.world if self._divide_after else 1
            self.engine.offload.step_unit(u, out, divide)
            # Free it now: the bucketer's work (kept until the end of backward) holds it
            out.untyped_storage().resize_(0)

    # -- per unit --------------------------------------------------------------------------------

    def _launch(self, k: int) -> Any:
        u = self._plan[k]
        slot = self._slot(u)
        for j, i in enumerate(u.ids):  # no gradient this backward: it contributes zeros
            if not self._got[i]:
                u.piece(slot, j).zero_()
        slot[u.offsets[-1] + u.shapes[-1].numel():].zero_()  # the padding
        out = self._destination(u)
        work = comms.reduce_scatter_bucket(out, slot, self._op, self.engine.group)
        del self._slots[u.index]
        self._in_flight.append((work, slot, u, out))
        return work

    def _destination(self, u: Unit) -> torch.Tensor:
        """The unit's reduced shard itself, unless this backward accumulates into it
        (offloaded: a buffer for this unit's step alone)."""
        if self.engine.offload is not None:
            return torch.empty(u.shard_numel, dtype=self.reduce_dtype)
        assert self.grads is not None
        mine = self.shard_grads[u.index]
        if self.fresh:
            return mine
        if self._scratch is None:
            self._scratch = Arena(self.engine.layout.shard_numel, self.reduce_dtype)
        offset = self.grads.offset_of(mine)
        out = self._scratch.buffer[offset : offset + u.shard_numel]
        self._landed.append((u, out))
        return out

    def _finalize(self) -> None:
        assert self._bucketer is not None
        for i in self._bucketer.missing_items():
            self._bucketer.mark_ready(i)
        self._bucketer.wait()
        self._bucketer.reset()
        while self._in_flight:
            self._recycle_oldest()
        self.engine.release_all()
        if self.grads is None:  # offloaded: every unit has stepped already
            self.fresh = True
            self._got = [False] * len(self._got)
            self._seen = [0] * len(self._seen)
            return
        if self._divide_after:  # no AVG on this backend: the sum, divided once
            reduced = [self.grads.buffer] if self.fresh else [out for _, out in self._landed]
            for t in reduced:
                t.div_(self.engine.world)
        for u, out in self._landed:
            self.shard_grads[u.index].add_(out)
        self._landed.clear()
        self._got = [False] * len(self._got)
        self._seen = [0] * len(self._seen)
        self.fresh = False

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.buffer.zero_()
        self.fresh = True
