"""ZeRO-Infinity offload for stage 3: each unit's shard, fp32 master and optimizer state live
in a :mod:`unit store <pycomm.parallel.zero.unit_store>` and are in memory only around their use.

The stage-3 engine (:class:`ShardedModel`) asks :class:`UnitOffload` for a unit's master
before it gathers the unit. In forward only the master is read, and dropped once the
gather has finished; in backward the whole record (master and optimizer state) is read,
kept until the unit's gradient shard has been reduce-scattered, then the unit's optimizer
step runs on it at once (:meth:`UnitOffload.step_unit`), and the record is written back
and dropped. So no whole gradient and no whole optimizer state exist at any time. Reads
run ``prefetch`` units ahead of use on background I/O threads (the forward order, and
the backward order, are the ones the first step recorded), so they overlap compute.

What is held at once is a few records (``prefetch`` ahead, the unit in use, those whose
reduction is in flight and up to :data:`MAX_WRITES` being written), whatever the depth of
the model. The optimizer's step counters (scalars) stay in memory.

The step of a unit is the inner optimizer's own ``step()``, given only that unit's pieces
(the others have no ``.grad`` and are skipped), with their state tensors pointed into the
record: the same per-element arithmetic, in the same dtype, as the in-memory ZeRO-3 step.

Gradient clipping needs the global norm before any unit steps, so with ``defer_step``
(DeepSpeed clips with offload too) backward writes each unit's reduced gradient shard
into its record (a ``grad`` field after the state, written alone: the master read for
the gather is unchanged) and adds its square to the norm; once the norm is known,
:meth:`UnitOffload.step_deferred` reads each whole record ahead of use, scales its
gradient by the clipping coefficient, steps it and writes back what the step changed
(master and state). Per step that is 10 fields moved instead of 7 (a read of the master
in forward and in backward, the gradient written in backward; four read and three
written by the step pass); each further micro-batch adds the master and the gradient
read and the gradient written. Fields are read and written only as runs of neighbours
(:func:`field_spans`), so a record buffer holds only what its pass touched.
fp16's loss scaling defers the step too: an overflowed step is dropped before any unit
steps.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pycomm.arena import return_freed_memory

from ..precision import sum_of_squares
from .unit_store import FileUnitStore, HostUnitStore, Record, RecordLayout
from .units import Unit

KINDS = ("cpu", "disk")
ADAM_STATE = ("exp_avg", "exp_avg_sq")  # Adam's and AdamW's state, beside the master
MAX_WRITES = 1  # write-backs in flight before the next one waits for the oldest
IO_THREADS = 2


@dataclass(frozen=True)
class Span:
    """A ZeRO-1/2 bucket as the store sees it: its index and this rank's shard size."""

    index: int
    shard_numel: int


@dataclass(frozen=True)
class OffloadConfig:
    """Offload of stage 3's units.

    Args:
        kind: ``"disk"`` (files under ``directory``) or ``"cpu"`` (host memory, for a
            model on a GPU; on a CPU the same pipeline with records in host memory).
        directory: where ``disk`` keeps one file per rank.
        prefetch: units read ahead of use (0: each is read when it is needed).
        defer_step: step the units after backward, once the gradient norm is known (for
            clipping), their reduced gradients kept in the records until then.
        microbatches: backwards per step: each unit's reduced gradients are summed in its
            record's ``grad`` (read with the master in backward) and the units step after
            the last (implies ``defer_step``).
        state_fields: the optimizer's per-element state tensors, beside the master in
            each record (:func:`pycomm.parallel.zero.offload_step.optimizer_state_layout`).
    """

    kind: str
    directory: str = ""
    prefetch: int = 2
    defer_step: bool = False
    microbatches: int = 1
    state_fields: tuple[str, ...] = ADAM_STATE

    def check(self) -> None:
        """Raises ValueError for an unknown kind, ``disk`` without a directory, or a
        negative prefetch depth."""
        if self.kind not in KINDS:
            raise ValueError(f"offload: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "disk" and not self.directory:
            raise ValueError("offload: 'disk' needs a directory (offload_dir)")
        if self.prefetch < 0:
            raise ValueError(f"offload: prefetch must be >= 0, got {self.prefetch}")
        if self.microbatches < 1:
            raise ValueError(f"offload: microbatches must be >= 1, got {self.microbatches}")


class UnitOffload:
    """Which units are in memory, their reads ahead and writes back, and their steps.

    Args:
        units: the engine's units; ``dtype``: the masters' dtype; ``device``: where the
            units compute; ``rank``: this rank in the world (names its file: every
            rank of the job has its own); ``masters``: the records hold the master
            (stage 3) or only the optimizer state (stages 1-2 keep masters in memory).
    """

    def __init__(self, config: OffloadConfig, units: list[Unit] | list[Span],
                 dtype: torch.dtype, device: torch.device, rank: int, masters: bool = True):
        config.check()
        return_freed_memory()
        self.config, self.units, self.device = config, units, device
        self.depth = config.prefetch
        self.defer = config.defer_step or config.microbatches > 1
        self.microbatches = config.microbatches
        self.state_fields = config.state_fields
        # what a step changes (the optimizer state alone where masters stay in memory)
        self.stepped = (*(("master",) if masters else ()), *config.state_fields)
        # the gradient last: a step writes back the fields before it, backward it alone
        fields = (*self.stepped, *(("grad",) if self.defer else ()))
        self.layouts = [RecordLayout(u.shard_numel, dtype, fields) for u in units]
        self.store: FileUnitStore | HostUnitStore = (
            FileUnitStore(config.directory, rank, self.layouts) if config.kind == "disk"
            else HostUnitStore(self.layouts))
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="zero-offload")
        self._records: dict[int, Record] = {}  # in memory (or being read)
        self._reads: dict[int, Future[None]] = {}
        self._writes: deque[tuple[int, Future[None], Record]] = deque()
        self._writing: dict[int, Future[None]] = {}
        self.backward = False  # reads bring the whole record (its step follows)
        self.stepping = False  # the deferred step pass: whole records, gradient included
        self.grad_factors: list[float] = []  # the deferred step's unscale and clipping
        self.deferred: list[int] = []  # units whose gradient waits in their record
        self._landed: dict[int, int] = {}  # unit -> backwards summed into its grad this step
        self.sequence: list[int] = []  # unit indices in the order of the current pass
        self.stepper: Callable[..., None] | None = None
        self.grad_square_sum = 0.0  # of the reduced shards this backward (the norm)
        # unit -> (start, count, weight) of shard elements counted other than once in the
        # norm (a parameter replicated over tensor-parallel ranks: 1 / its copies), from
        # ``weigh`` at the first use (the model's names are complete by then)
        self.norm_weights: dict[int, list[tuple[int, int, float]]] = {}
        self.weigh: Callable[[], dict[int, list[tuple[int, int, float]]]] | None = None
        self.stats = {"read_wait_s": 0.0, "write_wait_s": 0.0, "io_s": 0.0, "step_s": 0.0,
                      "max_records": 0, "steps": 0}
        weakref.finalize(self, _close, self._io, self.store)

    # -- records -------------------------------------------------------------------------------

    def _take(self, k: int) -> Record:
        record = Record(self.layouts[k], self.device)
        self._records[k] = record
        self.stats["max_records"] = max(self.stats["max_records"],
                                        len(self._records) + len(self._writes))
        return record

    def _give(self, record: Record) -> None:
        """Done with ``record``: its buffer goes back to the system now (a fresh mapping
        per use costs page faults, but holds only the fields a pass touched, and no
        record outlives its use)."""
        record.loaded = frozenset()
        record.release()

    def _needed(self, k: int) -> tuple[str, ...]:
        """Fields of unit ``k`` the current pass reads: the master for a gather; the
        whole record where a step follows (in backward, or in the deferred step pass);
        in a deferred backward, the master and the gradient summed so far (none before
        the step's first backward reaches the unit: it is overwritten)."""
        fields = self.layouts[k].fields
        if self.stepping or (self.backward and not self.defer):
            return fields
        if self.backward and self._landed.get(k, 0) > 0:
            return ("master", "grad")
        return ("master",)

    def fetch(self, k: int) -> None:
        """Start reading unit ``k`` (the fields this pass needs) unless it is in memory."""
        needed = self._needed(k)
        if k in self._records:
            if self._records[k].loaded.issuperset(needed) or k in self._reads:
                return  # a read still in flight: acquire checks what it brought
            self._give(self._records.pop(k))  # master only: the step needs the state too
        record = self._take(k)
        after = self._writing.get(k)
        self._reads[k] = self._io.submit(self._read, k, record, needed, after)

    def _read(self, k: int, record: Record, names: tuple[str, ...],
              after: Future[None] | None) -> None:
        if after is not None:
            after.result()  # the last step's values must be on the store first
        start = time.perf_counter()
        for first, count in field_spans(record.layout, names):
            self.store.read(k, record, first, count)
            record.to_device(first, count)
        record.loaded = frozenset(names)
        with self._lock:  # two I/O threads add to it
            self.stats["io_s"] += time.perf_counter() - start

    def acquire(self, k: int) -> Record:
        """Unit ``k``'s record with the fields this pass needs, read now if it was not
        read ahead (a forward's master-only record is read again, whole, in backward)."""
        while True:
            if k not in self._records:
                self.fetch(k)
            read = self._reads.pop(k, None)
            if read is not None:
                start = time.perf_counter()
                read.result()
                self.stats["read_wait_s"] += time.perf_counter() - start
            record = self._records[k]
            if record.loaded.issuperset(self._needed(k)):
                return record
            self._give(self._records.pop(k))

    def drop(self, k: int) -> None:
        """Forget unit ``k``'s record without writing it (its values are unchanged)."""
        read = self._reads.pop(k, None)
        if read is not None:
            read.result()
        if k in self._records:
            self._give(self._records.pop(k))

    def write_back(self, k: int, names: tuple[str, ...] | None = None) -> None:
        """Write unit ``k``'s fields ``names`` (default: what a step changes, the master
        and the optimizer state) to the store in the background, and drop the record."""
        while len(self._writes) >= MAX_WRITES:
            self._retire_write()
        record = self._records.pop(k)
        names = names or self.stepped
        record.forget(names)  # what is not written is not needed: its pages go now
        future = self._io.submit(self._write, k, record, names)
        self._writes.append((k, future, record))
        self._writing[k] = future

    def _write(self, k: int, record: Record, names: tuple[str, ...]) -> None:
        start = time.perf_counter()
        for first, count in field_spans(record.layout, names):
            record.to_host(first, count)
            self.store.write(k, record, first, count)
        with self._lock:
            self.stats["io_s"] += time.perf_counter() - start

    def _retire_write(self) -> None:
        k, future, record = self._writes.popleft()
        start = time.perf_counter()
        future.result()
        self.stats["write_wait_s"] += time.perf_counter() - start
        if self._writing.get(k) is future:
            del self._writing[k]
        self._give(record)

    def flush(self) -> None:
        """Wait for every write-back."""
        while self._writes:
            self._retire_write()

    # -- what the engine calls ----------------------------------------------------------------

    def begin_pass(self, backward: bool, sequence: list[int], stepping: bool = False) -> None:
        """A forward, a backward or the deferred step pass starts: units will be used in
        ``sequence``'s order."""
        self.backward, self.stepping, self.sequence = backward, stepping, sequence
        self._position = {k: j for j, k in enumerate(sequence)}
        for k in sequence[: self.depth]:
            self.fetch(k)
        if backward and not self.defer:  # deferred: the step pass resets it
            self.grad_square_sum = 0.0

    def ahead(self, u: Unit | Span) -> None:
        """``u`` is in use: read the next ``prefetch`` units of the pass."""
        j = self._position.get(u.index)
        if j is not None:
            for k in self.sequence[j + 1 : j + 1 + self.depth]:
                self.fetch(k)

    def master(self, u: Unit) -> torch.Tensor:
        """``u``'s master shard, for its gather."""
        return self.acquire(u.index).field("master")

    def gathered(self, u: Unit) -> None:
        """``u``'s gather finished: in forward its master is not needed any more."""
        if not self.backward:
            self.drop(u.index)

    def step_unit(self, u: Unit, grad: torch.Tensor, divide_by: int) -> None:
        """``u``'s reduced gradient shard is complete: step it now and write it back."""
        if self.stepper is None:
            raise RuntimeError("offload: a backward reached the optimizer step of unit "
                               f"{u.index}, but no ZeroOptimizer was built over this model")
        if divide_by > 1:  # no AVG on this backend: the sum, divided here
            grad.div_(divide_by)
        record = self.acquire(u.index)
        if self.defer:
            self._keep_grad(u.index, grad, record)
            return
        self.grad_square_sum += self._square_sum(u.index, grad)
        self._step_and_write(u, grad, record)

    def _square_sum(self, k: int, grad: torch.Tensor) -> float:
        """Unit ``k``'s share of the squared global norm: its reduced shard's squares,
        each element weighted as :attr:`norm_weights` says (1 where it does not)."""
        if self.weigh is not None:
            self.norm_weights, self.weigh = self.weigh(), None
        total = float(sum_of_squares(grad))
        for start, count, weight in self.norm_weights.get(k, ()):
            total += (weight - 1.0) * float(sum_of_squares(grad[start : start + count]))
        return total

    def _step_and_write(self, u: Unit | Span, grad: torch.Tensor, record: Record,
                        master: torch.Tensor | None = None) -> None:
        """Step ``u`` (its master in ``record``, or ``master`` where it stays in memory)
        from ``grad``, cast to the master's dtype where it was reduced in another, and
        write the record back."""
        dtype = (record.field("master") if master is None else master).dtype
        if grad.dtype != dtype:  # reduced in bf16: stepped in the master's dtype
            grad = grad.to(dtype)
        start = time.perf_counter()
        assert self.stepper is not None
        self.stepper(u, grad, record, master)
        self.stats["step_s"] += time.perf_counter() - start
        self.stats["steps"] += 1
        self.write_back(u.index)

    def _stepping_pass(self, order: list[int],
                       step: Callable[[Unit | Span, Record], None]) -> None:
        """Read every record of ``order`` ahead of use, whole, and ``step(unit, record)``
        each (which writes it back)."""
        if self.stepper is None:
            raise RuntimeError("offload: no ZeroOptimizer was built over these records")
        self.begin_pass(False, order, stepping=True)
        try:
            for k in order:
                self.ahead(self.units[k])
                step(self.units[k], self.acquire(k))
        finally:
            self.stepping = False

    def _keep_grad(self, k: int, grad: torch.Tensor, record: Record) -> None:
        """Deferred: ``grad`` into (the first backward of a step) or onto (the others)
        unit ``k``'s record beside its master; after the last, the unit waits to step."""
        seen = self._landed.pop(k, 0) + 1
        home = record.field("grad")
        home.copy_(grad) if seen == 1 else home.add_(grad)
        if seen == self.microbatches:
            self.grad_square_sum += self._square_sum(k, home)
            self.deferred.append(k)
        else:
            self._landed[k] = seen
        self.write_back(k, ("grad",))  # the master is unchanged

    @torch.no_grad()
    def step_deferred(self) -> None:
        """Step every unit from the gradient its record holds, multiplied by each of
        ``grad_factors`` (fp16's unscale, the clipping coefficient), reading ahead as a
        pass does (see the module docstring)."""

        def step(u: Unit | Span, record: Record) -> None:
            grad = record.field("grad")
            for factor in self.grad_factors:  # one rounding each, as in memory
                grad.mul_(factor)
            self._step_and_write(u, grad, record)

        order, self.deferred = self.deferred, []
        try:
            self._stepping_pass(order, step)
        finally:
            self.grad_factors, self.grad_square_sum = [], 0.0

    @torch.no_grad()
    def combine_deferred_grad(self, u: Unit, combine: Callable[[torch.Tensor], None]) -> None:
        """Deferred, after backward: ``combine`` applied in place to ``u``'s gradient in
        its record (a tied parameter's copies summed over the pipeline stages holding
        them), and the norm's share of ``u`` taken again."""
        if u.index not in self.deferred:
            raise RuntimeError(f"offload: unit {u.index}'s gradient is not waiting in its "
                               "record (combine_deferred_grad needs a deferred step)")
        view = self.stored(u, "grad")
        self.grad_square_sum -= self._square_sum(u.index, view)
        combine(view)
        self.grad_square_sum += self._square_sum(u.index, view)
        self.release_view(view, written=True)
        self.end_stored()

    def discard_deferred(self) -> None:
        """The step is skipped (fp16 overflow): the gradients in the records are left
        to be overwritten by the next step's first backward."""
        self.deferred, self._landed, self.grad_square_sum = [], {}, 0.0

    @torch.no_grad()
    def step_states(self, masters: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """ZeRO-Offload (stages 1-2): step every bucket's master shard (in memory) from
        its reduced gradient, its optimizer state read from the store ahead of use and
        written back after, one bucket at a time."""
        self._stepping_pass([u.index for u in self.units],
                            lambda u, record: self._step_and_write(
                                u, grads[u.index], record, masters[u.index]))

    @torch.no_grad()
    def read_master(self, u: Unit) -> torch.Tensor:
        """A copy of ``u``'s master shard (checkpoints, comparisons)."""
        resident = u.index in self._records
        out = self.acquire(u.index).field("master").clone()
        if not resident:
            self.drop(u.index)
        return out

    @torch.no_grad()
    def write_initial(self, u: Unit, shard: torch.Tensor) -> None:
        """``u``'s first values, with zero optimizer state, to the store (at sharding)."""
        record = self._take(u.index)
        record.data.zero_()
        record.field("master").copy_(shard)
        record.loaded = frozenset(record.layout.fields)
        self.write_back(u.index)

    def stored(self, u: Unit | Span, name: str) -> torch.Tensor:
        """``u``'s field ``name`` (``master`` or a state tensor) as a view of
        the store, read and written in place (checkpoints); every write-back has
        finished and no record is in memory. :meth:`end_stored` when done."""
        self.flush()
        if self._records or self._reads:
            raise RuntimeError("offload: the store is viewed in place only between steps "
                               f"(units {sorted(self._records)} are in memory)")
        layout = self.layouts[u.index]
        return self.store.field_view(u.index, layout, layout.fields.index(name))

    def release_view(self, view: torch.Tensor, written: bool) -> None:
        """A view of :meth:`stored` is done with: its pages go (flushed first when
        ``written``), so a checkpoint holds one chunk at a time."""
        self.store.release_view(view, written)

    def end_stored(self) -> None:
        """The views of :meth:`stored` are dropped: what they changed reaches the store."""
        self.store.end_views()

    def io_stats(self) -> dict[str, Any]:
        return {**self.stats, "bytes_read": self.store.bytes_read,
                "bytes_written": self.store.bytes_written}


def field_spans(layout: RecordLayout, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """``names``' fields as runs of neighbours, ``(first, count)``: one file call each."""
    spans: list[tuple[int, int]] = []
    for k in sorted(layout.fields.index(name) for name in names):
        if spans and spans[-1][0] + spans[-1][1] == k:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((k, 1))
    return spans


def _close(io: ThreadPoolExecutor, store: FileUnitStore | HostUnitStore) -> None:
    io.shutdown(wait=True)
    store.close()
