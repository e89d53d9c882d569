"""ZeRO as the data-parallel side of a composed job (``parallelize(..., zero=1..3)``).

Stages 1-2 reduce when :func:`parallel.compose.finalize.finalize_grads` says so (after the
tensor-parallel partial sums), from the gradients the pipeline's backwards accumulated
in ``.grad``. Stage 3 cannot wait (its units give their memory back in backward), so it
reduces each unit as backward finishes it; the tensor-parallel partial gradients are
then summed as they arrive, before the unit is reduced.

For the global norm, a rank's gradient is its shard of each bucket (stage 1: too, the
part it steps on), cut per parameter so a parameter replicated over tensor parallelism
is counted once. For checkpoints, each parameter and its optimizer state is gathered
whole over data parallelism (:class:`ShardCodec`), and split again on load, whatever the
saved layout's data-parallel size was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.compose.dp_plan import _cloned, _spec_tuple, param_groups, tp_copies
from parallel.compose.mesh import ParallelMesh
from parallel.models import Block
from parallel.zero import ZeroOptimizer, shard_model
from parallel.zero.shard_layout import ShardLayout

_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class ShardCodec:
    """Between per-parameter whole tensors and this rank's flat shard of each bucket."""

    def __init__(self, layout: ShardLayout, shapes: list[torch.Size], group: Any):
        self.layout, self.shapes, self.group = layout, shapes, group

    def gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter whole, from each rank's shard of each bucket (collective)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.shapes)
        world = self.layout.world
        for k, bucket in enumerate(self.layout.buckets):
            full = torch.empty(world * bucket.shard, dtype=shards[k].dtype)
            _all_gather(full, shards[k].detach().contiguous(), group=self.group)
            for i in bucket.params:
                at = self.layout.offsets[i] - bucket.start
                out[i] = full[at : at + self.layout.numels[i]].view(self.shapes[i]).clone()
        return out

    def scatter(self, whole: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's shard of each bucket, from every parameter whole."""
        shards = []
        for bucket in self.layout.buckets:
            full = torch.zeros(self.layout.world * bucket.shard, dtype=dtype)
            for i in bucket.params:
                at = self.layout.offsets[i] - bucket.start
                full[at : at + self.layout.numels[i]] = whole[i].reshape(-1)
            rank = self.layout.rank
            shards.append(full[rank * bucket.shard : (rank + 1) * bucket.shard].clone())
        return shards


class ZeroPlan:
    """ZeRO stage 1, 2 or 3 over the mesh's ``dp`` group (see the module docstring)."""

    def __init__(self, stage_module: nn.Module, params: list[nn.Parameter],
                 mesh: ParallelMesh, config: Any):
        self.mesh, self.zero = mesh, config.zero
        group = mesh.group("dp")
        groups = param_groups(params, config.weight_decay)  # by shape: before any sharding
        if config.zero == 3:
            blocks = [m for m in stage_module.children() if isinstance(m, Block)]
            shard_model(stage_module, group, unit_modules=blocks)
        self.optimizer = ZeroOptimizer(
            groups, config.optimizer, stage=config.zero,
            process_group=group, bucket_cap_mb=config.bucket_mb, reduce_in_backward=False,
            **config.optimizer_kwargs)
        shards: Any = self.optimizer._shards
        self.layout: ShardLayout = shards.layout
        self.params: list[nn.Parameter] = shards.params  # layout order
        shapes = self.optimizer.param_shapes()  # stage 3: the parameters themselves are empty
        self.codec = ShardCodec(self.layout, shapes, group)

    def reduce(self) -> None:
        self.optimizer.reduce_gradients()

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        return [(part, 1.0 / tp_copies(self.params[i], self.mesh))
                for i, part in self.optimizer.grad_parts()]

    # -- checkpoints ---------------------------------------------------------------------------

    def _state_shards(self) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
        """The inner optimizer's state as one flat shard per bucket and key, and its
        scalar entries (Adam's step)."""
        opt = self.optimizer
        tensors: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, Any] = {}
        for piece, q in zip(opt.pieces, opt.piece_params, strict=True):
            for key, value in opt.optimizer.state.get(q, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if key not in tensors:
                        tensors[key] = [torch.zeros(b.shard, dtype=value.dtype)
                                        for b in self.layout.buckets]
                    tensors[key][piece.bucket][piece.start : piece.stop] = value.reshape(-1)
                else:
                    scalars[key] = value
        return tensors, scalars

    def local_state(self, names: dict[int, str]) -> dict[str, Any]:
        """Every parameter and its optimizer state, whole over ``dp`` (collective)."""
        values = self.codec.gather(self.optimizer._shards.shard_params)  # fp32 masters
        tensors, scalars = self._state_shards()
        keys = sorted(tensors)
        dist.broadcast_object_list(keys, src=dist.get_global_rank(self.mesh.group("dp"), 0),
                                   group=self.mesh.group("dp"))  # every rank gathers alike
        whole = {key: self.codec.gather(tensors[key]) for key in keys}
        return {names[id(p)]: {"param": values[i], "spec": _spec_tuple(p),
                               "state": {**{k: whole[k][i] for k in keys}, **_cloned(scalars)}}
                for i, p in enumerate(self.params)}

    @torch.no_grad()
    def load_local_state(self, wanted: dict[int, dict[str, Any]]) -> None:
        opt = self.optimizer
        masters = self.codec.scatter([wanted[id(p)]["param"] for p in self.params],
                                     opt._shards.shard_params[0].dtype)
        for shard, values in zip(opt._shards.shard_params, masters, strict=True):
            shard.copy_(values)
        first = wanted[id(self.params[0])]["state"]
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
        shards = {k: self.codec.scatter([wanted[id(p)]["state"][k] for p in self.params],
                                        first[k].dtype) for k in keys}
        scalars = {k: v for k, v in first.items() if k not in keys}
        for piece, q in zip(opt.pieces, opt.piece_params, strict=True):
            state = {k: shards[k][piece.bucket][piece.start : piece.stop].clone() for k in keys}
            opt.optimizer.state[q] = {**state, **_cloned(scalars)}
        opt._shards.publish_shards()
