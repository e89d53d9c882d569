"""ZeRO-DP stages 1 and 2: the flat parameter buffer, this rank's master shards, and
the gradients reduced into them.

Stage 1: every rank keeps the whole gradient in a gradient arena, all-reduced in
buckets during backward (as data parallel), but optimizer state only for its shard of
each bucket; after its step it all-gathers the updated shards back into the parameters.
Stage 2 keeps only the rank's gradient shards: each bucket's gradient is whole only in
a buffer of the bucket's size, taken when its first gradient arrives and given back once
it is reduce-scattered into the shard (:class:`GradStream`). Its buckets are capped at
C_B and at a quarter of what the shards leave of the gradient, so the shards and the
buffers live at once hold less than stage 1's whole gradient whatever C_B is; where one
parameter too large to split would still make them hold more (or on a single rank),
stage 2 keeps the gradient whole as stage 1 does. At equal C_B it never holds more.

Parameters live in one flat buffer laid out by :class:`ShardLayout`; on a pycomm group
it is shared memory, so the all-gathers read peers' shards in place.
:class:`ZeroOptimizer` steps its inner optimizer on ``shard_params`` (the master
shards) with ``shard_grads``, then calls :meth:`FlatShards.publish_shards`.

Where the reduction lives (for a deferred mode that reduces outside backward):
``_on_grad_ready`` (per parameter, from autograd), ``_launch`` (one bucket's
collective), ``_finalize`` (end of backward: launch what is left, wait, average) and
:meth:`FlatShards.reduce_gradients` (all of it at once, outside backward).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.bucketer import Bucketer
from pycomm.flat_arena import Arena

from ..grad_hooks import EndOfBackward, move_grad_into, on_grad_ready
from . import zero_comms as comms
from .grad_stream import GradStream, window_numel
from .model_writes import ParamWatch
from .precision import Precision
from .shard_layout import ShardLayout

MB = 1 << 20


class FlatShards:
    """The stage 1-2 machinery behind :class:`ZeroOptimizer` (see there for the args).

    Args:
        params: the parameters, each once, of one dtype (layout order: reversed).
        stage: 1 or 2.
        process_group, bucket_cap_mb: as :class:`ZeroOptimizer`.
        precision: the master, compute and reduce dtypes.
    """

    def __init__(self, params: list[nn.Parameter], stage: int,
                 process_group: dist.ProcessGroup | None, bucket_cap_mb: float,
                 precision: Precision, reduce_in_backward: bool = True):
        if any(hasattr(p, "zero3") or hasattr(p, "zero3_param") for p in params):
            raise ValueError(f"ZeroOptimizer: stage {stage} got parameters of a model from "
                             "shard_model; a sharded model needs stage=3")
        self.stage, self.group, self.params = stage, process_group, params
        self._shapes = [p.shape for p in params]
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.precision = precision
        cap = self._bucket_cap(int(bucket_cap_mb * MB))
        self.layout = ShardLayout(self.params, self.world, self.rank, cap, self.precision.compute)
        self._op, self._divide_after = comms.averaging_op(process_group)
        self._adopt_params()
        # Deferred (a composed job's finalize_grads reduces, after the tensor-parallel
        # phase): backward leaves every gradient in .grad (or a view) for reduce_gradients.
        self.reduce_in_backward = reduce_in_backward
        self._make_grad_buffers(self.precision.reduce)
        self._bucketer = Bucketer([b.params for b in self.layout.buckets], self._launch)
        self._sync, self._fresh = True, True
        self._end_of_backward = EndOfBackward(self._finalize)
        if reduce_in_backward or (self._stream is not None and self._grads_are_views):
            on_grad_ready(self.params, self._on_grad_ready)
        self._watch = ParamWatch(self.params, self._param_view_of_flat)

    # -- setup -------------------------------------------------------------------------------

    def _bucket_cap(self, cap: int) -> int:
        """Stage 2 reduces each bucket out of a buffer of its own, taken when backward
        reaches the bucket: two of them beside the shards must hold less than the whole
        gradient (what stage 1 keeps), and one taken early must not outweigh the
        gradients autograd would have allocated by then. So its buckets are capped at a
        quarter of what the shards leave of the gradient, as well as at C_B."""
        if self.stage == 1 or self.world == 1:
            return cap
        whole = sum(p.numel() for p in self.params) * self.precision.compute.itemsize
        return max(1, min(cap, whole * (self.world - 1) // (4 * self.world)))

    def _param_view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        shape = self._shapes[i]  # as built: the parameter itself may have been replaced
        return buffer[self.layout.offsets[i] : self.layout.offsets[i] + shape.numel()].view(shape)

    def _adopt_params(self) -> None:
        """Move every parameter into the flat buffer (rank 0's values everywhere); the
        optimizer's parameters are this rank's shards of it, or fp32 copies of them."""
        prec, shards = self.precision, [b.shard_of(self.rank) for b in self.layout.buckets]
        with torch.no_grad():
            flat = Arena.for_group(self.layout.numel, prec.master, self.group)
            for i, p in enumerate(self.params):
                self._param_view(flat.buffer, i).copy_(p)
            comms.broadcast_flat(flat.buffer, self.group)
            self.masters: Arena | None = None
            if prec.mixed:
                self.masters = Arena(self.layout.shard_numel, prec.master)
                master_views = [self.masters.allocate(s.stop - s.start) for s in shards]
                for view, s in zip(master_views, shards, strict=True):
                    view.copy_(flat.buffer[s])
                low = Arena.for_group(self.layout.numel, prec.compute, self.group)
                low.buffer.copy_(flat.buffer)
                flat = low  # the whole fp32 copy is dropped here
            self.flat = flat
            for i, p in enumerate(self.params):
                p.data = self._param_view(self.flat.buffer, i)
        masters = master_views if prec.mixed else [self.flat.buffer[s] for s in shards]
        self.shard_params = [nn.Parameter(m) for m in masters]

    def _make_grad_buffers(self, dtype: torch.dtype) -> None:
        # Whole gradients (stage 1) are views of one arena, every .grad a view (as
        # pycomm.parallel.data); when reduced in another dtype than computed, each is added into
        # its view instead. Stage 2 streams them through bucket buffers into its shards.
        self._grads_are_views = self.precision.reduce == self.precision.compute
        self._stream: GradStream | None = None
        window = self._stream_window()
        if not self._streams(window):
            self.grads = Arena.for_group(self.layout.numel, dtype, self.group)
            self._point_grads_at_views()
            shard_grads = [self.grads.buffer[b.shard_of(self.rank)] for b in self.layout.buckets]
        else:
            self.grads = Arena(self.layout.shard_numel, dtype)
            shard_grads = [self.grads.allocate(b.shard) for b in self.layout.buckets]
            self._stream = GradStream(self.params, self.layout, shard_grads, dtype, self._op,
                                      self.group, window)
        self.shard_grads = shard_grads

    def _stream_window(self) -> int:
        """Bucket buffers live at once: two to overlap reducing with backward; deferred,
        one per bucket where gradients can move into them as they arrive (their .grad a
        view), else two while reduce_gradients copies them in."""
        if not self.reduce_in_backward and self._grads_are_views:
            return len(self.layout.buckets)
        return 2

    def _streams(self, window: int) -> bool:
        """Whether stage 2 streams its gradients: only where that holds no more, at peak,
        than keeping them whole (stage 1's arena; deferred, also the .grad tensors
        autograd allocates, which stay beside it until reduce_gradients copies them in)."""
        if self.stage == 1 or self.world == 1:
            return False
        itemsize = self.precision.reduce.itemsize
        autograd = sum(p.numel() for p in self.params) * self.precision.compute.itemsize
        whole = itemsize * self.layout.numel + (0 if self.reduce_in_backward else autograd)
        stream = itemsize * (self.layout.shard_numel + window_numel(self.layout, window))
        if not self.reduce_in_backward and not self._grads_are_views:
            stream += autograd  # they stay in .grad until copied in, bucket by bucket
        return stream <= whole

    def _point_grads_at_views(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = self._param_view(self.grads.buffer, i) if self._grads_are_views else None

    # -- backward ------------------------------------------------------------------------------

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if self._stream is not None:
            self._stream.on_grad(i, param, as_view=self._grads_are_views)
        else:
            self._into_arena(i, param)
        if not (self._sync and self.reduce_in_backward):
            return
        self._end_of_backward.request()
        self._bucketer.mark_ready(i)

    def _into_arena(self, i: int, param: torch.Tensor) -> None:
        view = self._param_view(self.grads.buffer, i)
        if self._grads_are_views:
            move_grad_into(param, view)
        elif param.grad is not None:
            view.add_(param.grad)
            param.grad = None

    def _launch(self, k: int) -> Any:
        if self._stream is not None:
            return self._stream.launch(k, accumulate=not self._fresh)
        full = self.grads.buffer[self.layout.buckets[k].full(self.world)]
        return dist.all_reduce(full, op=self._op, group=self.group, async_op=True)

    def _finalize(self) -> None:
        missing = self._bucketer.missing_items()
        for i in missing:  # parameters without a gradient this backward contribute zeros
            self._bucketer.mark_ready(i)
        self._bucketer.wait()
        self._bucketer.reset()
        if self._stream is not None:
            self._stream.finish()
        # Without AVG (gloo) the reduction is a sum; accumulating, it is world x the old
        # gradient plus the new sum (stage 1: every rank adds the same averaged gradient
        # back in; stage 2: GradStream adds world x the shard), so one division averages.
        if self._divide_after:
            self.grads.buffer.div_(self.world)
        self._fresh = False

    # -- after the step ------------------------------------------------------------------------

    @torch.no_grad()
    def publish_shards(self) -> None:
        """Every rank's (updated) shards into every rank's parameters (collective)."""
        if self.precision.mixed:
            for b, master in zip(self.layout.buckets, self.shard_params, strict=True):
                self.flat.buffer[b.shard_of(self.rank)].copy_(master)
        works = [comms.all_gather_shard(self.flat.buffer[b.full(self.world)], self.rank, self.group)
                 for b in self.layout.buckets]
        for work in works:
            work.wait()

    def reduce_gradients(self) -> None:
        """Reduce, now and outside backward, every bucket not reduced yet, from the
        parameters' gradients (stage 1: what ``no_sync`` accumulated; a deferred mode:
        everything), then average as the end of a backward does."""
        if self._stream is None and not self.reduce_in_backward:
            self._gather_grads_into_arena()
        self._finalize()

    @torch.no_grad()
    def _gather_grads_into_arena(self) -> None:
        """Deferred, whole gradients: the parameters' gradients (left in .grad by backward) into
        the gradient arena the buckets reduce."""
        for i, p in enumerate(self.params):
            view = self._param_view(self.grads.buffer, i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view if self._grads_are_views else None

    @torch.no_grad()
    def adopt_model_writes(self) -> None:
        """Keep weights written into the model since the last step (``load_state_dict``,
        in-place edits, replaced tensors): re-point replaced parameters into the flat
        buffer and, under mixed precision, re-seed the masters of this rank's pieces of
        written parameters from them. A piece whose values still equal its masters
        rounded to the compute dtype keeps its masters, so loading this optimizer's
        ``state_dict`` before or after the model's gives the same, exact, masters."""
        changed = self._watch.changed()
        if changed and self.precision.mixed:
            self._reseed_masters(changed)
        self._watch.remember()

    def _reseed_masters(self, changed: list[int]) -> None:
        bucket_of = self.layout.bucket_of_param()
        for i in changed:
            k = bucket_of[i]
            mine = self.layout.buckets[k].shard_of(self.rank)
            lo = max(self.layout.offsets[i], mine.start)
            hi = min(self.layout.offsets[i] + self.params[i].numel(), mine.stop)
            if lo >= hi:
                continue
            model = self.flat.buffer[lo:hi]
            master = self.shard_params[k].detach()[lo - mine.start : hi - mine.start]
            if not torch.equal(model, master.to(model.dtype)):
                master.copy_(model)

    def _param_view_of_flat(self, i: int) -> torch.Tensor:
        return self._param_view(self.flat.buffer, i)

    def zero_grad(self) -> None:
        """Zero the reduced gradients (stage 1: the whole-gradient arena, whose views
        some ``.grad`` may be; stage 2: this rank's shards, which a backward that
        reaches no bucket leaves as they are, and drop any bucket not reduced yet)."""
        if self._stream is not None:
            self._stream.discard()
        self.grads.buffer.zero_()
        self._fresh = True

    @contextmanager
    def no_sync(self) -> Any:
        """Stage 1 only: accumulate whole gradients locally; the next backward outside
        reduces the sum (stage 2 reduces every backward: it keeps no whole gradients)."""
        if self.stage != 1:
            raise RuntimeError("ZeroOptimizer.no_sync: stage 2 keeps no whole gradients to "
                               "accumulate; just call backward again (shards accumulate)")
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- reporting -----------------------------------------------------------------------------

    @property
    def masters_in_model(self) -> bool:
        """Whether the master shards are the model's own values (fp32: views of the
        flat buffer) rather than separate fp32 copies."""
        return not self.precision.mixed

    def param_shapes(self) -> list[torch.Size]:
        """The shape of each of :attr:`params` (checkpoints)."""
        return [p.shape for p in self.params]

    def param_names(self, model: nn.Module) -> list[str]:
        """The qualified name in ``model`` of each of :attr:`params` (checkpoints)."""
        by_id = {id(p): n for n, p in model.named_parameters()}
        missing = [i for i, p in enumerate(self.params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"zero checkpoint: optimizer parameters {missing} are not in "
                             "the model")
        return [by_id[id(p)] for p in self.params]

    def memory_stats(self, state_bytes: int) -> dict[str, int]:
        """Bytes this rank holds for parameters (compute dtype), fp32 master shards
        (mixed precision), reduced gradients (stage 1, or stage 2 kept whole: the whole
        gradient), optimizer state (``state_bytes``) and stage 2's bucket buffers (live
        now, and the most live at once so far)."""
        stream = self._stream
        return {
            "param_bytes": self.flat.stats()["reserved_bytes"],
            "master_bytes": self.masters.stats()["reserved_bytes"] if self.masters else 0,
            "grad_bytes": self.grads.stats()["reserved_bytes"],
            "optimizer_state_bytes": state_bytes,
            "bucket_bytes": stream.live_bytes if stream else 0,
            "bucket_peak_bytes": stream.peak_bytes if stream else 0,
        }
