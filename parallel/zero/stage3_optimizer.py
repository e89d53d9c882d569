"""``ZeroOptimizer(..., stage=3)``: the optimizer side of a model from :func:`shard_model`.

The model owns the sharded parameters and fills their gradients (reduce-scattered per
unit during backward); this class steps ``optimizer_class`` on the shards, clips by
the global norm, and afterwards lets the next forward gather the updated values. With
``mixed_precision`` the shards stay the fp32 master copy and optimizer state; units are
gathered and computed in the low precision, and gradients are reduced in
``reduce_dtype``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.zero.precision import Precision, step_on_masters
from parallel.zero.sharded_model import ShardedModel
from parallel.zero.zero_optimizer import ZeroOptimizer, _check_params


def _engine_of(params: list[nn.Parameter]) -> ShardedModel:
    engines = [getattr(p, "zero3", (None,))[0] for p in params]
    if not params or any(e is None for e in engines):
        raise ValueError("ZeroOptimizer: stage 3 needs the parameters of a model sharded "
                         "by parallel.zero.shard_model (model = shard_model(model); "
                         "ZeroOptimizer(model.parameters(), ..., stage=3))")
    if len({id(e) for e in engines}) > 1:
        raise ValueError("ZeroOptimizer: stage 3 parameters come from more than one "
                         "sharded model; use one optimizer per model")
    engine: ShardedModel = params[0].zero3[0]  # type: ignore[attr-defined]
    if missing := len(engine.units) - len(params):
        raise ValueError(f"ZeroOptimizer: stage 3 needs every shard of the model; "
                         f"{missing} of {len(engine.units)} were not passed")
    return engine


class Stage3Optimizer(ZeroOptimizer):
    """Created by ``ZeroOptimizer(model.parameters(), cls, stage=3, ...)``; see there."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                 stage: int = 3, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, mixed_precision: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, **optimizer_kwargs: Any):
        self.stage = stage
        engine = _engine_of(_check_params([p for p in params if p.requires_grad]))
        if process_group is not None and process_group is not engine.group:
            raise ValueError("ZeroOptimizer: process_group differs from the one the model "
                             "was sharded over; pass the same group (or None)")
        self.engine, self.group = engine, engine.group
        self.world, self.rank = engine.world, engine.rank
        self.precision = Precision.choose(engine.dtype, mixed_precision, reduce_dtype)
        if self.precision.mixed:
            engine.set_precision(self.precision.compute, self.precision.reduce)
        self.params, self.layout = engine.params, engine.layout
        self.shard_params = [u.shard for u in engine.units]  # layout order
        self.grads = engine.reducer.grads
        self.shard_grads = engine.reducer.shard_grads
        self.flat = engine.masters
        self.optimizer = optimizer_class(self.shard_params, **optimizer_kwargs)

    def param_shapes(self) -> list[torch.Size]:
        return [shape for u in self.engine.units for shape in u.shapes]

    def param_names(self, model: nn.Module) -> list[str]:
        if model.__dict__.get("zero3") is not self.engine:
            raise ValueError("zero checkpoint: the optimizer's parameters are not this model's")
        return list(self.engine.names)

    @torch.no_grad()
    def step(self) -> None:
        """Step on this rank's shards; the next forward gathers the new values."""
        step_on_masters(self.optimizer, self.shard_params, self.shard_grads)
        self.engine.publish_shards()

    def publish_shards(self) -> None:
        self.engine.publish_shards()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.reducer.zero_grad()

    @contextmanager
    def no_sync(self) -> Any:
        raise RuntimeError("ZeroOptimizer.no_sync: stage 3 keeps no whole gradients to "
                           "accumulate; just call backward again (shards accumulate)")
        yield  # pragma: no cover

    def memory_stats(self) -> dict[str, int]:
        """Bytes of this rank's shards (master, and compute-dtype copies), master
        gradients, optimizer state, and the pooled whole-unit buffers (gathered
        parameters, including the persistent unit, and gradients being reduced)."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        comm = getattr(self.engine, "comm_arena", None)
        masters = self.flat.stats()["reserved_bytes"]
        return {
            "param_bytes": comm.stats()["reserved_bytes"] if comm else masters,
            "master_bytes": masters if comm else 0,
            "grad_bytes": self.grads.stats()["reserved_bytes"],
            "optimizer_state_bytes": state,
            "bucket_bytes": self.engine.pool.stats()["reserved_bytes"],
            "bucket_peak_bytes": self.engine.pool.stats()["peak_bytes"],
        }
