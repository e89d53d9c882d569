"""Where stage 3 keeps each unit's master shard, chosen once by :func:`shard_model`.

:class:`ShardsInMemory` keeps the masters in one arena of the group (shared memory on
pycomm, so the all-gathers read them in place) and, under mixed precision, a copy in
the compute dtype that the gathers read. :class:`OffloadedShards` keeps them in the unit
store's records (:mod:`pycomm.parallel.zero.offload`): each gather reads the unit's
record, ahead of time, and casts its master. ``ShardedModel`` asks its home; it never
asks which one it has.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pycomm.flat_arena import Arena

from .grad_sinks import IntoShardGrads, StepOnArrival
from .offload import OffloadConfig, UnitOffload
from .units import Unit


class ShardsInMemory:
    """The masters in an arena of ``numel`` elements; see the module docstring."""

    offload = None  # the unit store: none

    def __init__(self, numel: int, dtype: torch.dtype, group: dist.ProcessGroup | None):
        self.masters = Arena.for_group(numel, dtype, group)
        self.numel, self.dtype, self.group = numel, dtype, group
        self.compute_copy: Arena | None = None  # the shards in the compute dtype

    def place(self, u: Unit, mine: torch.Tensor) -> torch.Tensor:
        """Keep ``mine`` (this rank's part of ``u``, in the masters' dtype); the shard."""
        view = self.masters.allocate(u.shard_numel)
        view.copy_(mine)
        return view

    def shard_views(self, units: list[Unit], arena: Arena) -> list[torch.Tensor]:
        """Each unit's shard in ``arena`` (of any dtype), at the masters' offsets."""
        views = []
        for u in units:
            at = self.masters.offset_of(u.shard.detach())
            views.append(arena.buffer[at : at + u.shard_numel])
        return views

    def set_compute_dtype(self, units: list[Unit], dtype: torch.dtype) -> None:
        """Gathers read a copy of the shards in ``dtype`` (half the bytes in bf16)."""
        if dtype == self.dtype:
            return
        self.compute_copy = Arena.for_group(self.masters.capacity, dtype, self.group)
        for u, view in zip(units, self.shard_views(units, self.compute_copy), strict=True):
            u.comm_shard = view

    @torch.no_grad()
    def publish(self, units: list[Unit]) -> None:
        """After the masters changed: refresh the compute-dtype copy."""
        if self.compute_copy is not None:
            for u in units:
                u.comm_shard.copy_(u.shard)

    def grad_sink(self, dtype: torch.dtype, shard_views: Callable[[Arena], list[torch.Tensor]]
                  ) -> IntoShardGrads:
        """Reduced gradients land in shard gradients in memory (in ``dtype``)."""
        return IntoShardGrads(self.numel, dtype, shard_views)

    def begin_forward(self, sequence: list[int]) -> None:
        """(Nothing to read ahead: the shards are in memory.)"""

    def begin_backward(self, sequence: Callable[[], list[int]]) -> None:
        """(Nothing to read ahead: the shards are in memory.)"""

    def ahead(self, u: Unit) -> None:
        """(Nothing to read ahead: the shards are in memory.)"""

    def can_prefetch(self) -> bool:
        """Whether a gather may start ahead of its use: always, its shard is here."""
        return True

    def gather_source(self, u: Unit, dtype: torch.dtype) -> torch.Tensor:
        """What ``u``'s all-gather sends: its shard, in the compute dtype."""
        return u.comm_shard

    def gathered(self, u: Unit) -> None:
        """(The source is the shard itself: nothing to drop.)"""

    def master(self, u: Unit) -> torch.Tensor:
        """``u``'s master shard."""
        return u.shard.detach()

    def arenas(self) -> tuple[Arena | None, Arena]:
        """The shards' arenas in memory: (compute-dtype copy, masters)."""
        return self.compute_copy, self.masters


class OffloadedShards:
    """The masters in the unit store (files by world ``rank``); see the module docstring."""

    def __init__(self, config: OffloadConfig, units: list[Unit], dtype: torch.dtype,
                 device: torch.device, rank: int):
        self.offload = UnitOffload(config, units, dtype, device, rank)
        self.dtype = dtype

    def place(self, u: Unit, mine: torch.Tensor) -> torch.Tensor:
        """Write ``mine`` to ``u``'s record; the shard in memory is empty."""
        self.offload.write_initial(u, mine)
        return torch.empty(0, dtype=self.dtype)

    def set_compute_dtype(self, units: list[Unit], dtype: torch.dtype) -> None:
        """(Each gather casts the master it reads: no copy is kept.)"""

    def publish(self, units: list[Unit]) -> None:
        """(The next gathers read the records the step wrote.)"""

    def grad_sink(self, dtype: torch.dtype, shard_views: Callable[[Arena], list[torch.Tensor]]
                  ) -> StepOnArrival:
        """Each reduced gradient steps its unit as it arrives (in ``dtype``)."""
        return StepOnArrival(self.offload, dtype)

    def begin_forward(self, sequence: list[int]) -> None:
        """Reads follow ``sequence`` (unit indices, in the order forward needs them)."""
        self.offload.begin_pass(False, sequence)

    def begin_backward(self, sequence: Callable[[], list[int]]) -> None:
        """Reads (and each unit's step) follow ``sequence()``, once per backward."""
        if not self.offload.backward:
            self.offload.begin_pass(True, sequence())

    def ahead(self, u: Unit) -> None:
        """Issue the reads that run ahead of ``u``'s gather."""
        self.offload.ahead(u)

    def can_prefetch(self) -> bool:
        """Whether a gather may start ahead of its use: only with reads two units ahead
        (otherwise its read was issued just now, or never, and the gather would wait)."""
        return self.offload.depth >= 2

    def gather_source(self, u: Unit, dtype: torch.dtype) -> torch.Tensor:
        """The record's master, cast to ``dtype``: kept as ``u.comm_shard`` (the gather
        reads it later) until :meth:`gathered`."""
        u.comm_shard = self.offload.master(u).to(dtype)
        return u.comm_shard

    def gathered(self, u: Unit) -> None:
        """The gather is done: its source and the unit's record are not kept."""
        u.comm_shard = torch.empty(0, dtype=self.dtype)
        self.offload.gathered(u)

    def master(self, u: Unit) -> torch.Tensor:
        """``u``'s master shard, read from its record."""
        return self.offload.read_master(u)

    def arenas(self) -> tuple[None, None]:
        """The shards' arenas in memory: none (compute-dtype copy, masters)."""
        return None, None


ShardHome = ShardsInMemory | OffloadedShards
