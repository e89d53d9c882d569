"""ZeRO-DP stages 1 and 2: optimizer state (and gradients) partitioned across ranks.

Stage 1: every rank keeps the whole gradient in a gradient arena, all-reduced in
buckets during backward (as data parallel), but optimizer state only for its shard of
each bucket; after its step it all-gathers the updated shards back into the parameters.
Stage 2: each bucket's gradients are packed into one of two constant-size bucket
buffers and reduce-scattered straight into the rank's gradient shard as soon as the
bucket is complete; the full gradients are freed then, so a rank holds ``1/world`` of
the gradients plus the buckets in flight.

Parameters live in one flat buffer laid out by :class:`ShardLayout`; on a pycomm group
it is shared memory, so the all-gathers read peers' shards in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.grad_hooks import EndOfBackward, move_grad_into, on_grad_ready
from parallel.zero import zero_comms as comms
from parallel.zero.precision import Precision, step_on_masters
from parallel.zero.shard_layout import ShardLayout
from pycomm.bucketer import Bucketer
from pycomm.flat_arena import Arena

MB = 1 << 20


def _check_params(params: list[Any]) -> list[nn.Parameter]:
    if any(isinstance(p, dict) for p in params):
        raise TypeError("ZeroOptimizer: pass parameters, not parameter groups (dicts)")
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(f"ZeroOptimizer: parameter {i} is the same tensor as parameter "
                             f"{seen[id(p)]}; pass each parameter once")
        seen[id(p)] = i
    if len({p.dtype for p in params}) > 1:
        dtypes = sorted({str(p.dtype) for p in params})
        raise ValueError(f"ZeroOptimizer: parameters must share one dtype, got {dtypes}")
    return params


class ZeroOptimizer:
    """Wrap ``optimizer_class`` so each rank keeps state only for its ``1/world`` shard.

    Args:
        params: the model's parameters (each once), all of one dtype.
        optimizer_class: any ``torch.optim`` optimizer (AdamW, Adam, SGD, ...).
        stage: 1 (optimizer state sharded), 2 (also gradients) or 3 (also parameters:
            pass the parameters of a model from :func:`parallel.zero.shard_model`).
        process_group: the data-parallel group (None: default).
        bucket_cap_mb: bucket size (C_B); stage 3 reduces per unit instead.
        mixed_precision: compute and communicate in this dtype (``torch.bfloat16``),
            keeping fp32 master shards and optimizer state.
        reduce_dtype: reduce gradients in this dtype (default: ``mixed_precision``).
        **optimizer_kwargs: passed to ``optimizer_class``.

    Raises:
        ValueError: a stage other than 1-3, a parameter passed twice, mixed dtypes,
            shards of a sharded model below stage 3 or plain parameters at stage 3.

    Example::

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        opt.zero_grad(); loss.backward(); opt.clip_grad_norm_(1.0); opt.step()
    """

    def __new__(cls, params: Any = None, optimizer_class: Any = None, stage: int = 1,
                *args: Any, **kwargs: Any) -> ZeroOptimizer:
        if cls is ZeroOptimizer and stage == 3:  # the model is sharded: another machine
            from parallel.zero.stage3_optimizer import Stage3Optimizer

            return super().__new__(Stage3Optimizer)
        return super().__new__(cls)

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                 stage: int = 1, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, mixed_precision: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, **optimizer_kwargs: Any):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3 (got {stage!r})")
        self.stage, self.group = stage, process_group
        self.params = _check_params([p for p in params if p.requires_grad])
        if any(hasattr(p, "zero3") for p in self.params):
            raise ValueError(f"ZeroOptimizer: stage {stage} got the shards of a model from "
                             "shard_model; a sharded model needs stage=3")
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        master = self.params[0].dtype if self.params else torch.float32
        self.precision = Precision.choose(master, mixed_precision, reduce_dtype)
        cap = int(bucket_cap_mb * MB)
        self.layout = ShardLayout(self.params, self.world, self.rank, cap, self.precision.compute)
        self._op, self._divide_after = comms.averaging_op(process_group)
        self._adopt_params()
        self._make_grad_buffers(self.precision.reduce)
        self.optimizer = optimizer_class(self.shard_params, **optimizer_kwargs)
        self._bucketer = Bucketer([b.params for b in self.layout.buckets], self._launch)
        self._sync, self._fresh = True, True
        self._end_of_backward = EndOfBackward(self._finalize)
        on_grad_ready(self.params, self._on_grad_ready)

    # -- setup -------------------------------------------------------------------------------

    def _param_view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return buffer[self.layout.offsets[i] : self.layout.offsets[i] + p.numel()].view_as(p)

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
        shards = [self.flat.buffer[b.shard_of(self.rank)] for b in self.layout.buckets]
        # Stage 1 keeps whole gradients, every .grad a view (as parallel.data); when they
        # are reduced in another dtype than computed, each is added into its view instead.
        self._grads_are_views = self.precision.reduce == self.precision.compute
        if self.stage == 1:
            self.grads = Arena.for_group(self.layout.numel, dtype, self.group)
            self._point_grads_at_views()
            shard_grads = [self.grads.buffer[b.shard_of(self.rank)] for b in self.layout.buckets]
        else:  # only this rank's shards, plus two bucket buffers for packing
            self.grads = Arena(self.layout.shard_numel, dtype)
            shard_grads = [self.grads.allocate(s.numel()) for s in shards]
            biggest = max((b.shard * self.world for b in self.layout.buckets), default=0)
            self._bucket_buffers = [Arena.for_group(biggest, dtype, self.group) for _ in range(2)]
            self._free = [a.buffer for a in self._bucket_buffers]
            self._in_flight: list[tuple[Any, torch.Tensor]] = []
            self._scratch: torch.Tensor | None = None
        self.shard_grads = shard_grads

    def _point_grads_at_views(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = self._param_view(self.grads.buffer, i) if self._grads_are_views else None

    # -- backward ------------------------------------------------------------------------------

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if self.stage == 1:
            view = self._param_view(self.grads.buffer, i)
            if self._grads_are_views:
                move_grad_into(param, view)
            elif param.grad is not None:
                view.add_(param.grad)
                param.grad = None
        if not self._sync:
            return
        self._end_of_backward.request()
        self._bucketer.mark_ready(i)

    def _launch(self, k: int) -> Any:
        bucket = self.layout.buckets[k]
        if self.stage == 1:
            full = self.grads.buffer[bucket.full(self.world)]
            return dist.all_reduce(full, op=self._op, group=self.group, async_op=True)
        base = self._take_buffer()
        buffer = base[: bucket.shard * self.world]
        used = 0
        for i in bucket.params:
            p = self.params[i]
            start = self.layout.offsets[i] - bucket.start
            target = buffer[start : start + p.numel()]
            if p.grad is None:  # no gradient this backward: it contributes zeros
                target.zero_()
            else:
                target.copy_(p.grad.reshape(-1))
            used = max(used, start + p.numel())
            p.grad = None  # the full gradient is not kept (stage 2)
        buffer[used:].zero_()
        out = self.shard_grads[k] if self._fresh else self._scratch_for(k)
        work = comms.reduce_scatter_bucket(out, buffer, self._op, self.group)
        self._in_flight.append((work, base))
        return work

    def _take_buffer(self) -> torch.Tensor:
        """A free bucket buffer; if both are in flight, wait for the older."""
        if not self._free:
            work, base = self._in_flight.pop(0)
            work.wait()
            self._free.append(base)
        return self._free.pop(0)

    def _scratch_for(self, k: int) -> torch.Tensor:
        """Where a reduce-scatter lands when gradients accumulate over several backwards."""
        if self._scratch is None:
            self._scratch = torch.empty(self.layout.shard_numel, dtype=self.grads.dtype)
        offsets = self.layout.local_offsets()
        return self._scratch[offsets[k] : offsets[k] + self.layout.buckets[k].shard]

    def _finalize(self) -> None:
        missing = self._bucketer.missing_items()
        for i in missing:  # parameters without a gradient this backward contribute zeros
            self._bucketer.mark_ready(i)
        self._bucketer.wait()
        self._bucketer.reset()
        if self.stage == 2:
            self._in_flight.clear()
            self._free = [a.buffer for a in self._bucket_buffers]
        # What this backward produced: the gradients themselves, or (accumulating in
        # stage 2) the scratch that is added to them. Without AVG (gloo) it is a sum.
        added = self._scratch if self.stage == 2 and not self._fresh else self.grads.buffer
        if self._divide_after and added is not None:
            added.div_(self.world)
        if added is not self.grads.buffer and added is not None:
            self.grads.buffer.add_(added)
        self._fresh = False

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Step on this rank's shards, then all-gather every bucket's updated shards."""
        step_on_masters(self.optimizer, self.shard_params, self.shard_grads)
        self.publish_shards()

    @torch.no_grad()
    def publish_shards(self) -> None:
        """Every rank's (updated) shards into every rank's parameters."""
        if self.precision.mixed:
            for b, master in zip(self.layout.buckets, self.shard_params, strict=True):
                self.flat.buffer[b.shard_of(self.rank)].copy_(master)
        works = [comms.all_gather_shard(self.flat.buffer[b.full(self.world)], self.rank, self.group)
                 for b in self.layout.buckets]
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (stage 1: the arena, in place, so the views stay; stage 2:
        the next backward overwrites this rank's shards)."""
        if self.stage == 1:
            self.grads.buffer.zero_()
            self._point_grads_at_views()
        else:
            for p in self.params:
                p.grad = None
            self.grads.buffer.zero_()  # a backward that reaches no bucket leaves zeros
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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global 2-norm over every rank's shards; returns that norm."""
        total = comms.global_sq_norm(self.shard_grads, self.group).sqrt()
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for g in self.shard_grads:
                g.mul_(coef)
        return total.to(self.precision.master)

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

    # -- reporting -----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for parameters (compute dtype), fp32 master shards
        (mixed precision), reduced gradients, optimizer state and buckets."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        buckets = sum(a.stats()["reserved_bytes"] for a in getattr(self, "_bucket_buffers", []))
        return {
            "param_bytes": self.flat.stats()["reserved_bytes"],
            "master_bytes": self.masters.stats()["reserved_bytes"] if self.masters else 0,
            "grad_bytes": self.grads.stats()["reserved_bytes"],
            "optimizer_state_bytes": state,
            "bucket_bytes": buckets,
        }
