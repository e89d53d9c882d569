"""ZeRO as the data side of a composed job (``parallelize(..., zero=1..3)``).

Stages 1-2 reduce when :func:`pycomm.parallel.compose.finalize.finalize_grads` says so (after
the tensor-parallel partial sums), from the gradients the pipeline's backwards
accumulated in ``.grad``. Stage 3 cannot wait (its units give their memory back in
backward), so it reduces each unit as backward finishes it; tensor-parallel partial
gradients are then summed as they arrive, before the unit is reduced. Its units are the
plan's (by default the blocks), the stage's other parameters forming the stage's own.

With mixed precision the model computes in the low dtype while the optimizer steps the
fp32 master shards (:class:`pycomm.parallel.zero.ZeroOptimizer`'s ``mixed_precision``).

For the global norm, a rank's gradient is its shard of each bucket, cut per parameter
so a parameter held by several model-parallel ranks (replicated over TP, a tie on two
stages) is counted once. For checkpoints, each rank's pieces of each parameter (a flat
range of its tensor-parallel part) and of its optimizer state are views of the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpointing.optim_groups import ensure_state
from ..mesh import ParallelMesh
from ..zero import ZeroOptimizer, shard_model
from ..zero.offload import OffloadConfig
from ..zero.offload_step import optimizer_state_layout
from ..zero.sharded_checkpoint import owned_pieces, state_slices
from ..zero.sharded_model import DEFAULT_PERSISTENCE_THRESHOLD, LiveBudget
from .zero_state import InMemory, StateInStore, UnitsInStore, ZeroState

# (parameter, its shape, flat start, master values, optimizer state tensors, scalar state)
Piece = tuple[nn.Parameter, torch.Size, int, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]


def _groups_by_name(stage: nn.Module, weight_decay: float, exclude: set[str]
                    ) -> list[tuple[list[str], float]]:
    """Matrices decay, vectors do not (by name: stage 3 empties the parameters);
    ``exclude`` (names) are left to another optimizer."""
    named = [(n, p) for n, p in stage.named_parameters() if n not in exclude]
    decay = [n for n, p in named if p.dim() >= 2 and p.requires_grad]
    rest = [n for n, p in named if p.dim() < 2 and p.requires_grad]
    return [(decay, weight_decay), (rest, 0.0)]


class ZeroPlan:
    """ZeRO stage 1, 2 or 3 over the mesh's ``dp`` group (see the module docstring).

    Args:
        stage_module: this rank's pipeline stage (stage 3 shards it in place).
        mesh, config: the job's.
        compute: the dtype forward and backward run in.
        copies: ``copies(p)``: ranks of one replica holding the same gradient.
        unit_modules: stage 3's gather units; ``never_persistent`` names kept in them.
        materialize: for a meta-device model, gives named parameters their weights.
        exclude: names of parameters ZeRO leaves alone (the experts beside it, whole,
            :mod:`pycomm.parallel.compose.expert_side`; stage 3 neither shards nor gathers them).
        axis: the mesh dimension sharded over (``"edp"``: the experts' own ZeRO).
        stage: the ZeRO stage, if not ``config.zero``.
        grad_scale: multiplies the gradients before they are averaged over ``axis`` (the
            experts: summed over edp, divided by dp).
        defer: offloaded at stage 3, step every unit after backward whatever else asks
            for it (a tie across pipeline stages: its copies' gradients are summed then).
    """

    def __init__(self, stage_module: nn.Module, mesh: ParallelMesh, config: Any,
                 compute: torch.dtype, copies: Callable[[nn.Parameter], int],
                 unit_modules: list[nn.Module] | None = None,
                 never_persistent: tuple[str, ...] = (),
                 materialize: Callable[[list[str]], None] | None = None,
                 exclude: set[str] | None = None, axis: str = "dp", stage: int | None = None,
                 grad_scale: float = 1.0, defer: bool = False):
        self.zero = config.zero if stage is None else stage
        self.mesh, self.copies, self.grad_scale = mesh, copies, grad_scale
        group = mesh.group(axis)
        by_name = _groups_by_name(stage_module, config.weight_decay, exclude or set())
        units_store = None
        if self.zero == 3:
            offload = None if config.offload == "none" else OffloadConfig(
                config.offload, config.offload_dir, config.offload_prefetch,
                # fp16: a step that overflowed is skipped, known only after backward
                defer_step=(defer or config.max_grad_norm is not None
                            or compute == torch.float16),
                state_fields=optimizer_state_layout(config.optimizer,
                                                    config.optimizer_kwargs)[0],
                microbatches=config.microbatches)
            # offloaded, no unit stays gathered: a persistent one grows with the depth
            threshold = DEFAULT_PERSISTENCE_THRESHOLD if offload is None else 0
            shard_model(stage_module, group, unit_modules=unit_modules,
                        persistence_threshold=threshold, never_persistent=never_persistent,
                        materialize=materialize, offload=offload, exclude=exclude or (),
                        budget=LiveBudget(config.max_live_units, config.max_live_bytes))
            units_store = stage_module.__dict__["zero3"].offload
        named = dict(stage_module.named_parameters())
        zero3: Any = stage_module.__dict__.get("zero3")
        if zero3 is not None:  # the parameters as stage 3 keeps them (made from meta there)
            named.update(zip(zero3.names, zero3.params, strict=True))
        groups = [{"params": [named[n] for n in names], "weight_decay": decay}
                  for names, decay in by_name]
        master = next(p.dtype for names, _ in by_name for p in (named[n] for n in names))
        mixed = compute if compute != master else None
        self.optimizer = ZeroOptimizer(
            groups, config.optimizer, stage=self.zero, process_group=group,
            bucket_cap_mb=config.bucket_mb, reduce_in_backward=False, mixed_precision=mixed,
            reduce_dtype=config.reduce_dtype if mixed else None, **config.optimizer_kwargs)
        self.params: list[nn.Parameter] = self.optimizer.params  # layout order
        if self.zero < 3 and config.offload != "none":  # ZeRO-Offload: the state in a store
            self.optimizer.offload_states(OffloadConfig(config.offload, config.offload_dir,
                                                        config.offload_prefetch))
        self.state: ZeroState = InMemory()
        if units_store is not None:
            self.state = UnitsInStore(units_store)
            # (at the first step: parameters made from meta are named once the plan is built)
            units_store.weigh = self._norm_weights
        elif self.optimizer.state_offload is not None:
            self.state = StateInStore(self.optimizer.state_offload)

    def _norm_weights(self) -> dict[int, list[tuple[int, int, float]]]:
        """Stage 3 offload's norm: each unit's shard elements of a parameter held by
        several model-parallel ranks (replicated over tp) weighted 1 / its copies, as
        :meth:`grad_parts` weighs them in memory."""
        weights: dict[int, list[tuple[int, int, float]]] = {}
        for i, k, lo, hi, at in owned_pieces(self.optimizer):
            copies = self.copies(self.params[i])
            if copies != 1:
                weights.setdefault(k, []).append((at, hi - lo, 1.0 / copies))
        return weights

    def step_offloaded(self, unscale: float, clip: float) -> None:
        """Offloaded with clipping or loss scaling: every unit steps now, its gradient
        times ``unscale`` then ``clip`` (each skipped where it is 1, as in memory)."""
        self.state.step_deferred(unscale, clip)

    def reduce(self) -> None:
        if self.grad_scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.grad_scale)
        self.optimizer.reduce_gradients()

    def after_step(self) -> None:
        """(The optimizer publishes the shards itself.)"""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.state.discard_deferred()

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        return self.state.grad_parts(self)

    def shard_grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        """Each parameter's part of this rank's reduced shards, weighted 1 / its copies."""
        return [(part, 1.0 / self.copies(self.params[i]))
                for i, part in self.optimizer.grad_parts()]

    def sum_tied_shards(self, tied: list[tuple[nn.Parameter, Any]],
                        sum_grads: Callable[[list[tuple[torch.Tensor, Any]]], None]) -> None:
        """Stage 3: each tied parameter's reduced gradient (its unit holds it alone),
        summed over its group by ``sum_grads``, wherever the state keeps it."""
        self.state.sum_tied(self, tied, sum_grads)

    def units_of(self, tied: list[tuple[nn.Parameter, Any]]) -> list[tuple[int, Any]]:
        """The unit index of each tied parameter, with its group."""
        index = {id(p): i for i, p in enumerate(self.params)}
        bucket = self.optimizer.layout.bucket_of_param()
        return [(bucket[index[id(p)]], group) for p, group in tied]

    def shard_grads_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Stage 3: the reduced gradient shard of each of ``params``' units, each unit
        holding that parameter alone (a tie across pipeline stages)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        bucket = self.optimizer.layout.bucket_of_param()
        return [self.optimizer.shard_grads[bucket[index[id(p)]]] for p in params]

    def pieces(self) -> list[Piece]:
        """For checkpoints: this rank's flat range of each parameter it owns elements
        of, with the master values and optimizer state there (views of the shards;
        offloaded, views of the unit store, :meth:`stored_pieces`)."""
        return self.state.pieces(self)

    def memory_pieces(self) -> list[Piece]:
        """:meth:`pieces` where the state is in memory: views of the shards."""
        opt = self.optimizer
        ensure_state(opt.optimizer)
        shapes, out = opt.param_shapes(), []
        for i, k, lo, hi, at in owned_pieces(opt):
            state = state_slices(opt, k, at, hi - lo)
            piece = self._piece_param(k, at)
            scalars = {key: v for key, v in opt.optimizer.state[piece].items()
                       if not (torch.is_tensor(v) and v.dim() > 0)}
            values = opt.shard_params[k].detach()[at : at + hi - lo]
            out.append((self.params[i], shapes[i], lo, values, state, scalars))
        return out

    def _piece_param(self, k: int, at: int) -> nn.Parameter:
        """The inner optimizer's parameter holding element ``at`` of unit/bucket ``k``."""
        opt = self.optimizer
        return next(q for p, q in zip(opt.pieces, opt.piece_params, strict=True)
                    if p.bucket == k and p.start <= at < p.stop)

    def stored_pieces(self, store: Any) -> list[Piece]:
        """Offloaded: the pieces' optimizer state (stage 3: and values) are views of the
        unit store (a checkpoint streams through them, no record is read whole), the
        scalars (step counters) those in memory. Every piece gets the optimizer's state
        skeleton (counters at 0 before any step), so a load can set the counters and the
        next step finds the state in the records rather than starting it again."""
        opt = self.optimizer
        inner = opt.optimizer
        empty = torch.empty(0)
        fields, scalars_at_zero = optimizer_state_layout(type(inner), dict(inner.defaults))
        for q in opt.piece_params:
            state = inner.state[q]
            for key, value in scalars_at_zero.items():
                state.setdefault(key, value.clone() if torch.is_tensor(value) else value)
            for name in fields:
                state.setdefault(name, empty)
        views: dict[int, dict[str, torch.Tensor]] = {}
        shapes, out = opt.param_shapes(), []
        for i, k, lo, hi, at in owned_pieces(opt):
            if k not in views:
                views[k] = {name: store.stored(store.units[k], name) for name in store.stepped}
            n = hi - lo
            state = {name: views[k][name][at : at + n] for name in fields}
            scalars = {key: inner.state[self._piece_param(k, at)][key] for key in scalars_at_zero}
            master = views[k]["master"] if "master" in views[k] else opt.shard_params[k].detach()
            out.append((self.params[i], shapes[i], lo, master[at : at + n], state, scalars))
        return out

    def set_scalars(self, p: nn.Parameter, scalars: dict[str, Any]) -> None:
        # each piece its own copy: optimizers count steps in place (Adam's ``step``)
        for state in self.optimizer.optimizer.state.values():
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})

    def release_view(self) -> Any:
        """For checkpoints: how a chunk viewing the unit store lets its pages go
        (``dcp_chunks.save``'s ``release``), None where the state is in memory."""
        return self.state.release_view()

    def saved(self) -> None:
        """After a checkpoint was written from :meth:`pieces`' views."""
        self.state.saved()

    def loaded(self) -> None:
        """After a checkpoint was read into the master shards: every rank's parameters."""
        self.saved()  # offloaded: what was read into the store's views reaches it
        self.optimizer.publish_shards()
