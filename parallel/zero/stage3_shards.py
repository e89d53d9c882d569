"""ZeRO stage 3 behind :class:`ZeroOptimizer`: the shards of a model from :func:`shard_model`.

The model owns the sharded parameters and fills their gradients (reduce-scattered per
unit during backward, by its :class:`UnitGradReducer`); :class:`ZeroOptimizer` steps
its inner optimizer on the shards and then calls :meth:`Stage3Shards.publish_shards`,
after which the next forward gathers the updated values. With ``mixed_precision`` the
shards stay the fp32 master copy and optimizer state; units are gathered and computed
in the low precision, and gradients are reduced in ``reduce_dtype``.

The optimizer may be given the shards (``model.parameters()``) or the model's original
parameters (collected before :func:`shard_model`, e.g. to put biases and norms in a
group without weight decay); either way each original parameter must be in exactly
one group.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .precision import Precision
from .sharded_model import ShardedModel


def _tag(p: torch.Tensor) -> tuple[ShardedModel, int] | None:
    """(engine, unit index) of a shard, (engine, parameter index) of an original."""
    return getattr(p, "zero3", None) or getattr(p, "zero3_param", None)


def engine_of(tensors: list[torch.Tensor]) -> ShardedModel:
    """The one sharded model that all ``tensors`` (shards or originals) belong to.

    Raises:
        ValueError: a tensor of no sharded model, or of two different ones.
    """
    tags = [_tag(p) for p in tensors]
    if not tensors or any(t is None for t in tags):
        raise ValueError("ZeroOptimizer: stage 3 needs the parameters of a model sharded "
                         "by pycomm.parallel.zero.shard_model (model = shard_model(model); "
                         "ZeroOptimizer(model.parameters(), ..., stage=3))")
    engines = {id(t[0]): t[0] for t in tags if t is not None}
    if len(engines) > 1:
        raise ValueError("ZeroOptimizer: stage 3 parameters come from more than one "
                         "sharded model; use one optimizer per model")
    return next(iter(engines.values()))


def group_of_params(engine: ShardedModel, members: list[list[torch.Tensor]]) -> list[int]:
    """The group of each of ``engine.params``: a shard puts all of its unit's parameters
    in its group, an original parameter itself.

    Raises:
        ValueError: a parameter in two groups (or twice), or one in none.
    """
    group_of = [-1] * len(engine.params)
    for g, tensors in enumerate(members):
        for p in tensors:
            is_shard = hasattr(p, "zero3")
            _, index = p.zero3 if is_shard else p.zero3_param  # type: ignore[attr-defined]
            for i in engine.units[index].ids if is_shard else [index]:
                if group_of[i] >= 0:
                    raise ValueError(f"ZeroOptimizer: parameter {engine.names[i]!r} is passed "
                                     f"twice (groups {group_of[i]} and {g}); pass it once")
                group_of[i] = g
    missing = [engine.names[i] for i, g in enumerate(group_of) if g < 0]
    if missing:
        raise ValueError(f"ZeroOptimizer: stage 3 needs every parameter of the sharded "
                         f"model; {len(missing)} of {len(group_of)} were not passed, e.g. "
                         f"{missing[:3]}")
    return group_of


class Stage3Shards:
    """The stage-3 machinery behind :class:`ZeroOptimizer`, over ``engine`` (``model.zero3``).

    Raises:
        ValueError: ``process_group`` is not the group the model was sharded over.
    """

    stage = 3
    masters_in_model = True  # the shards are the model's parameters (and fp32 masters)

    def __init__(self, engine: ShardedModel, process_group: dist.ProcessGroup | None,
                 precision: Precision):
        if process_group is not None and process_group is not engine.group:
            raise ValueError("ZeroOptimizer: process_group differs from the one the model "
                             "was sharded over; pass the same group (or None)")
        self.engine, self.group = engine, engine.group
        self.world, self.rank = engine.world, engine.rank
        self.precision = precision
        if precision.mixed:
            engine.set_precision(precision.compute, precision.reduce)
        self.params, self.layout = engine.params, engine.layout
        self.shard_params = [u.shard for u in engine.units]  # layout order
        self.offload = engine.offload  # None, or units stepped in backward from their store

    @property
    def grads(self) -> Any:
        return self.engine.reducer.grads

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        return self.engine.reducer.shard_grads

    def param_shapes(self) -> list[torch.Size]:
        return [shape for u in self.engine.units for shape in u.shapes]

    def param_names(self, model: nn.Module) -> list[str]:
        if model.__dict__.get("zero3") is not self.engine:
            raise ValueError("zero checkpoint: the optimizer's parameters are not this model's")
        return list(self.engine.names)

    def publish_shards(self) -> None:
        """The next forward gathers the (updated) shards; not a collective."""
        self.engine.publish_shards()

    def adopt_model_writes(self) -> None:
        """Shards written since the last step (``model.load_state_dict``) are published;
        the model also checks this before every forward."""
        self.engine.adopt_model_writes()

    def zero_grad(self) -> None:
        self.engine.reducer.zero_grad()

    @contextmanager
    def no_sync(self) -> Any:
        raise RuntimeError("ZeroOptimizer.no_sync: stage 3 keeps no whole gradients to "
                           "accumulate; just call backward again (shards accumulate)")
        yield  # pragma: no cover

    def memory_stats(self, state_bytes: int) -> dict[str, int]:
        """Bytes of this rank's shards (master, and compute-dtype copies), master
        gradients, optimizer state (``state_bytes``), and the pooled whole-unit buffers
        (gathered parameters, including the persistent unit, and gradients being
        reduced)."""
        comm, masters = (arena.stats()["reserved_bytes"] if arena is not None else 0
                         for arena in self.engine.home.arenas())
        grads = self.grads.stats()["reserved_bytes"] if self.grads is not None else 0
        return {
            "param_bytes": comm or masters,
            "master_bytes": masters if comm else 0,
            "grad_bytes": grads,
            "optimizer_state_bytes": state_bytes,
            "bucket_bytes": self.engine.pool.stats()["reserved_bytes"],
            "bucket_peak_bytes": self.engine.pool.stats()["peak_bytes"],
        }
