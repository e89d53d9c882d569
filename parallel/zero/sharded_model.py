"""ZeRO stage 3: every rank keeps ``1/world`` of each unit's parameters; a unit is
gathered just before its forward (and again before its backward) and freed after.

:func:`shard_model` moves each unit's parameters into a flat, padded shard registered
on the unit's module (``zero3_shard``: what ``model.parameters()`` and the optimizer
see). The original parameter objects stay the module's attributes, so the model's code
is unchanged, but they hold no memory between uses: a forward pre-hook all-gathers the
unit into a buffer from a :class:`SlotPool` and points them at it; a forward hook frees
it and arms a hook on the outputs that gathers it again when their gradient arrives.
Once the forward order is known, the next unit's gather is started while the current
one computes (forward: the next; backward: the previous). Gradients are reduce-scattered
per unit by :class:`UnitGradReducer`.

Example::

    model = shard_model(GPT(cfg))                 # every rank, same model
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=3, lr=1e-3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from pycomm._extension import load as _extension
from pycomm.arena import return_freed_memory
from pycomm.flat_arena import Arena

from . import zero_comms as comms
from .offload import OffloadConfig
from .shard_homes import OffloadedShards, ShardHome, ShardsInMemory
from .shard_layout import ShardLayout
from .slot_pool import SlotPool
from .unit_grads import UnitGradReducer
from .units import Unit, plan_units

SHARD_NAME = "zero3_shard"
PERSISTENT_SHARD_NAME = "zero3_persistent_shard"
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # elements, as DeepSpeed's default


@dataclass(frozen=True)
class LiveBudget:
    """What stage 3 may hold at once beyond the unit in use (DeepSpeed's
    ``stage3_max_live_parameters``, in units and bytes): a unit is gathered ahead only
    while the units gathered stay within ``max_live_units`` and the whole-unit buffers
    (gathered parameters, gradients being reduced) within ``max_live_bytes``; the pool
    frees what it would keep beyond ``max_live_bytes``. A unit in use is gathered whatever
    the budget (it cannot run without), so the bytes can exceed it by what one layer
    needs; ``max_gathered_units`` and the pool's ``peak_bytes`` say what was held."""

    max_live_units: int | None = None
    max_live_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_live_units", "max_live_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"shard_model: {name} must be >= 1 (or None), got {value}")


def _on_first_grad(output: Any, fn: Any) -> None:
    """Call ``fn()`` when backward first reaches any tensor of ``output`` (before the
    nodes that produced it run)."""
    outs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
    if outs:
        torch.autograd.graph.register_multi_grad_hook(outs, lambda _grad: fn(), mode="any")


class ShardedModel:
    """The stage-3 machinery attached to a model (``model.zero3``); see :func:`shard_model`."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None,
                 unit_modules: Iterable[nn.Module] | None, persistence_threshold: int,
                 never_persistent: Iterable[str] = (),
                 materialize: Callable[[list[str]], None] | None = None,
                 offload: OffloadConfig | None = None, exclude: Iterable[str] = (),
                 budget: LiveBudget | None = None):
        self.model, self.group = model, group
        self.budget = budget or LiveBudget()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._materialize = materialize
        plans = plan_units(model, unit_modules, persistence_threshold, never_persistent,
                           exclude)
        self.aliases = {n: a for plan in plans for n, a in plan.aliases.items()}
        named = dict(model.named_parameters())
        self.names = [n for plan in plans for n in plan.names]
        self.params = [named[n] for n in self.names]
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError(f"shard_model: parameters must share one dtype, got "
                             f"{sorted({str(p.dtype) for p in self.params})}")
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.compute_dtype = self.dtype
        groups, start = [], 0
        for plan in plans:
            groups.append(list(range(start, start + len(plan.names))))
            start += len(plan.names)
        self.layout = ShardLayout.from_groups([p.numel() for p in self.params], groups,
                                              self.world, self.rank, self.dtype)
        self.pool = SlotPool(group, self.budget.max_live_bytes)
        if self.budget.max_live_bytes is not None:
            return_freed_memory()  # a buffer the pool drops goes back to the system
        self.units = [Unit(k, plan, [self.params[i] for i in ids], ids, self.layout, k)
                      for k, (plan, ids) in enumerate(zip(plans, groups, strict=True))]
        self.home = self._home(offload)
        self.offload = self.home.offload  # the unit store, where the reducer steps units
        self.unit_of = {i: u for u in self.units for i in u.ids}
        self._ext = _extension()
        self._empty = torch.empty(0, dtype=self.dtype)
        self._make_shards()
        self._detach_params()
        self._make_homes()
        self._install_hooks()
        self.order: list[int] | None = None  # unit indices in forward order (first step)
        self._recording: list[int] = []
        self._persistent_stale = True
        self._versions = [u.shard._version for u in self.units]  # as last published
        # gathers issued, of them started ahead by prefetch, prefetches the budget held
        # back, and most units gathered at once
        self.stats = {"gathers": 0, "prefetches": 0, "held_back": 0, "max_gathered_units": 0}
        self.reducer = UnitGradReducer(self)

    # -- construction ------------------------------------------------------------------------

    def _home(self, offload: OffloadConfig | None) -> ShardHome:
        """Where the master shards live: in memory, or (``offload``) in the unit store."""
        if offload is None:
            return ShardsInMemory(self.layout.shard_numel, self.dtype, self.group)
        device = next((p.device for p in self.params if not p.is_meta), torch.device("cpu"))
        return OffloadedShards(offload, self.units, self.dtype, device,  # files by world rank
                               dist.get_rank())

    def _materialized(self, u: Unit) -> None:
        """A model built on the meta device gets ``u``'s weights now, just before they
        are sharded (so no rank holds more than one unit whole)."""
        if self._materialize is None or not any(p.is_meta for p in u.params):
            return
        self._materialize(u.names)
        u.params = [self.model.get_parameter(n) for n in u.names]
        for i, p in zip(u.ids, u.params, strict=True):
            self.params[i] = p

    def _make_shards(self) -> None:
        """Rank 0's values, unit by unit: broadcast whole, keep this rank's shard."""
        with torch.no_grad():
            for u in self.units:
                self._materialized(u)
                full = self.pool.take(u.full_numel, self.dtype)
                full.zero_()
                for j, p in enumerate(u.params):
                    u.piece(full, j).copy_(p.reshape(-1))
                    if self._materialize is not None:  # made here: freed here, not after all
                        p.data = torch.empty(0, dtype=p.dtype)
                dist.broadcast(full, src=comms.src_rank(self.group), group=self.group)
                mine = full[self.rank * u.shard_numel : (self.rank + 1) * u.shard_numel]
                view = self.home.place(u, mine)
                u.shard = nn.Parameter(view)
                u.shard.zero3 = (self, u.index)  # type: ignore[attr-defined]
                u.comm_shard = view
                self.pool.give(full)

    def _detach_params(self) -> None:
        """The originals leave ``_parameters`` (plain attributes now, holding no memory,
        tagged so an optimizer can place them); each unit's module registers its shard."""
        for u in self.units:
            for name, p, i in zip(u.names, u.params, u.ids, strict=True):
                for alias in [name, *self.aliases.get(name, [])]:
                    owner, _, attr = alias.rpartition(".")
                    module = self.model.get_submodule(owner)
                    del module._parameters[attr]
                    module.__dict__[attr] = p
                p.data = self._empty
                p.zero3_param = (self, i)  # type: ignore[attr-defined]
            u.module.register_parameter(self._shard_name(u), u.shard)

    @staticmethod
    def _shard_name(u: Unit) -> str:
        return PERSISTENT_SHARD_NAME if u.persistent else SHARD_NAME

    def _make_homes(self) -> None:
        self._empty = torch.empty(0, dtype=self.compute_dtype)
        for u in self.units:
            u.homes = [self._ext.unbound_tensor(list(shape), self.compute_dtype)
                       for shape in u.shapes]

    def set_precision(self, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """Compute and gather in ``compute_dtype``; reduce gradients in ``reduce_dtype``
        (the shards stay the master copy, in the parameters' dtype)."""
        if any(u.bound or u.pending is not None for u in self.units):
            raise RuntimeError("set_precision: call it before the first forward")
        self.compute_dtype = compute_dtype
        self.reducer.set_reduce_dtype(reduce_dtype)
        self.home.set_compute_dtype(self.units, compute_dtype)
        self._make_homes()
        self.publish_shards()

    def shard_views(self, arena: Arena) -> list[torch.Tensor]:
        """Each unit's shard in ``arena`` (of any dtype), at the masters' offsets.

        Raises:
            TypeError: offloaded (the shards are in the unit store, in no arena).
        """
        if not isinstance(self.home, ShardsInMemory):
            raise TypeError("shard_views: offloaded shards are in the unit store, not in "
                            "an arena")
        return self.home.shard_views(self.units, arena)

    def _install_hooks(self) -> None:
        self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        self.model.register_forward_hook(self._end_forward)
        for u in self.units:
            if u.persistent:
                continue
            u.module.register_forward_pre_hook(lambda _m, _a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda _m, _a, out, u=u: self._post_forward(u, out))

    # -- forward ---------------------------------------------------------------------------------

    def _begin_forward(self, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.adopt_model_writes()
        persistent = [u.index for u in self.units if u.persistent]
        self.home.begin_forward(persistent + (self.order or []))
        if self._persistent_stale:
            for u in self.units:
                if u.persistent:
                    self._gather_into_slot(u)
                    self.bind(u)
            self._persistent_stale = False
        if self.compute_dtype == self.dtype:
            return None
        cast = self._cast_input
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _cast_input(self, value: Any) -> Any:
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def _pre_forward(self, u: Unit) -> None:
        if self.order is None and torch.is_grad_enabled():
            self._recording.append(u.index)
        self._bind_and_prefetch(u, +1)

    def _post_forward(self, u: Unit, output: Any) -> None:
        grads = torch.is_grad_enabled()
        if grads:
            _on_first_grad(output, lambda: self._pre_backward(u))
        # The model's own unit is needed first by backward: keep it (as FSDP does).
        if not (grads and u.module is self.model):
            self.release(u)

    def _end_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():  # even a model whose units are all persistent
            _on_first_grad(output, self._begin_backward)

    # -- backward --------------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        if self.order is None:
            self.order = list(dict.fromkeys(self._recording))
            self._position = {index: j for j, index in enumerate(self.order)}
        self.home.begin_backward(self.backward_unit_order)
        self.reducer.begin_backward()

    def _pre_backward(self, u: Unit) -> None:
        self._begin_backward()
        self._bind_and_prefetch(u, -1)

    def backward_unit_order(self) -> list[int]:
        """Units in the order their gradients complete: reverse forward order, then any
        unit forward did not reach, then the persistent one."""
        seen = list(reversed(self.order or []))
        rest = [u.index for u in self.units if u.index not in seen and not u.persistent]
        return seen + rest + [u.index for u in self.units if u.persistent]

    # -- gathering and freeing -------------------------------------------------------------------

    def _bind_and_prefetch(self, u: Unit, step: int) -> None:
        self.bind(u)
        self.home.ahead(u)  # offloaded, its reads run ahead of the gathers
        self._prefetch(u, step)

    def _prefetch(self, u: Unit, step: int) -> None:
        if self.order is None or u.index not in self._position:
            return
        j = self._position[u.index] + step
        if 0 <= j < len(self.order):
            nxt = self.units[self.order[j]]
            if not self.home.can_prefetch():
                return
            if not nxt.bound and nxt.pending is None:
                if not self._within_budget(nxt):
                    self.stats["held_back"] += 1
                    return
                self._gather_into_slot(nxt)
                self.stats["prefetches"] += 1

    def _within_budget(self, u: Unit) -> bool:
        """Whether gathering ``u`` ahead keeps the units gathered and the pool's bytes
        within the budget (the same answer on every rank: it depends on sizes only)."""
        limit = self.budget.max_live_units
        gathered = sum(v.slot is not None for v in self.units if not v.persistent)
        if limit is not None and gathered + 1 > limit:
            return False
        return self.pool.would_fit(u.full_numel * self.compute_dtype.itemsize)

    def _gather_into_slot(self, u: Unit) -> None:
        if u.slot is None:
            u.slot = self.pool.take(u.full_numel, self.compute_dtype)
        source = self.home.gather_source(u, self.compute_dtype)
        u.pending = comms.gather_unit(u.slot, source, self.group)
        self.stats["gathers"] += 1
        gathered = sum(v.slot is not None for v in self.units)
        self.stats["max_gathered_units"] = max(self.stats["max_gathered_units"], gathered)

    def bind(self, u: Unit) -> None:
        """Make ``u``'s parameters hold its gathered values (gathering now if needed)."""
        if u.pending is None and not u.bound:
            self._gather_into_slot(u)
        if u.pending is not None:
            self._gathered(u)
        if u.bound:
            return
        assert u.slot is not None
        for j, (home, p) in enumerate(zip(u.homes, u.params, strict=True)):
            self._ext.bind_storage(home, u.piece(u.slot, j))
            p.data = home
        u.bound = True

    def _gathered(self, u: Unit) -> None:
        u.pending.wait()
        u.pending = None
        self.home.gathered(u)

    def release(self, u: Unit) -> None:
        """Free ``u``'s gathered parameters (the slot goes back to the pool)."""
        if u.pending is not None:  # prefetched but never used
            self._gathered(u)
        for home, p in zip(u.homes, u.params, strict=True):
            self._ext.unbind_storage(home)
            p.data = self._empty
        if u.slot is not None:
            self.pool.give(u.slot)
        u.slot, u.bound = None, False

    def release_all(self) -> None:
        for u in self.units:
            if not u.persistent and (u.bound or u.pending is not None):
                self.release(u)

    def publish_shards(self) -> None:
        """After the masters changed (a step, a checkpoint load): refresh the compute-dtype
        shards, and let the next forward gather everything afresh."""
        self.release_all()
        self.home.publish(self.units)
        self._persistent_stale = True
        self._versions = [u.shard._version for u in self.units]

    @torch.no_grad()
    def adopt_model_writes(self) -> None:
        """Publish shards written outside a step (``model.load_state_dict``: their version
        counters moved; ``assign=True``: another tensor is registered, whose values are
        copied into the shard, which is registered again), so no forward gathers stale
        compute-dtype copies or a stale persistent unit."""
        replaced = False
        for u in self.units:
            current = u.module._parameters.get(self._shard_name(u))
            if current is not u.shard and current is not None:
                if current.shape != u.shard.shape:
                    raise ValueError(f"shard_model: unit {u.index}'s shard was replaced by a "
                                     f"tensor of shape {tuple(current.shape)}; it has "
                                     f"shape {tuple(u.shard.shape)}")
                u.shard.copy_(current)
                u.module.register_parameter(self._shard_name(u), u.shard)
                replaced = True
        if replaced or [u.shard._version for u in self.units] != self._versions:
            self.publish_shards()

    # -- reporting -------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (master dtype) and the buffers; collective."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            full = torch.empty(u.full_numel, dtype=self.dtype)
            comms.gather_unit(full, self.home.master(u), self.group).wait()
            for j, name in enumerate(u.names):
                out[name] = u.piece(full, j).view_as(u.homes[j]).clone()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if not isinstance(t, nn.Parameter):
                out[name] = t.detach().clone()
        return out


def shard_model(model: nn.Module, process_group: dist.ProcessGroup | None = None,
                unit_modules: Iterable[nn.Module] | None = None,
                persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
                never_persistent: Iterable[str] = (),
                materialize: Callable[[list[str]], None] | None = None,
                offload: OffloadConfig | None = None,
                exclude: Iterable[str] = (), budget: LiveBudget | None = None) -> nn.Module:
    """Shard ``model``'s parameters for ZeRO stage 3 (in place; collective).

    Args:
        model: the same model on every rank (rank 0's values are kept).
        process_group: the data-parallel group (None: default).
        unit_modules: modules each gathered as one unit; default: the children of every
            ``nn.ModuleList`` (transformer blocks), the rest forming the model's unit.
        persistence_threshold: parameters with fewer elements stay gathered all step.
        never_persistent: parameter names kept in their module's unit whatever their size.
        materialize: for a model on the meta device: ``materialize(names)`` gives those
            parameters their weights; called unit by unit just before each is sharded.
        offload: keep each unit's shard, fp32 master and optimizer state in a unit store
            (:mod:`pycomm.parallel.zero.offload`), stepped unit by unit in backward.
        exclude: parameter names left whole and untouched (another optimizer's: the
            experts beside ZeRO, :mod:`pycomm.parallel.compose.expert_side`).
        budget: bounds on the units gathered at once and the whole-unit buffers kept
            (:class:`LiveBudget`; default: none).

    Returns:
        ``model``, whose ``parameters()`` are now the shards; its machinery is
        ``model.zero3`` (a :class:`ShardedModel`).

    Raises:
        ValueError: a tied parameter whose users lie in different units, mixed dtypes, or
            unit modules that are not part of ``model``.
    """
    if "zero3" in model.__dict__:
        raise ValueError("shard_model: this model is already sharded")
    model.__dict__["zero3"] = ShardedModel(model, process_group, unit_modules,
                                           persistence_threshold, never_persistent, materialize,
                                           offload, exclude, budget)
    return model
