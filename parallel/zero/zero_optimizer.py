"""``ZeroOptimizer``: a ``torch.optim.Optimizer`` whose state is partitioned across ranks.

It wraps an inner ``torch.optim`` optimizer that steps only this rank's ``1/world`` of
the parameters (ZeRO's P_os). The stage-specific machinery is a collaborator:
:class:`FlatShards` for stages 1 and 2 (the model's parameters become views of one flat
buffer; gradients are all-reduced, or reduce-scattered, in buckets during backward) and
:class:`Stage3Shards` for stage 3 (a model from :func:`shard_model` owns the shards).
This class holds what every stage shares: the parameter groups a user (and an LR
scheduler) sees, the inner optimizer over this rank's pieces of each group
(:mod:`pycomm.parallel.zero.param_groups`), the step, clipping and the ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..precision import sum_of_squares
from ..tensor.sharding import model_parallel_groups, replicated_copies
from . import optimizer_state
from .flat_shards import FlatShards
from .offload import OffloadConfig, Span, UnitOffload
from .offload_step import optimizer_state_layout, unit_stepper
from .param_groups import (
    Piece,
    check_params,
    group_tensors,
    normalize_groups,
    options,
    plan_pieces,
)
from .precision import Precision, step_on_masters
from .stage3_shards import Stage3Shards, engine_of, group_of_params


class ZeroOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so each rank keeps state only for its ``1/world`` shard.

    Args:
        params: the model's parameters (each once, all of one dtype), or parameter
            groups as torch takes them (``[{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]``); per-group options apply to
            this rank's shards of that group's parameters. Stage 3: the sharded model's
            ``parameters()``, or its original parameters collected before
            :func:`shard_model` (to group them), each in exactly one group. Parameters
            that do not require grad are left out. Stages 1-2 lay buckets out in the
            order given (last first), so list parameters in the model's order.
        optimizer_class: an elementwise ``torch.optim`` optimizer (AdamW, Adam, SGD, ...).
        stage: 1 (optimizer state sharded), 2 (also gradients) or 3 (also parameters:
            pass the parameters of a model from :func:`pycomm.parallel.zero.shard_model`).
        process_group: the data-parallel group (None: default).
        bucket_cap_mb: bucket size (C_B); stage 3 reduces per unit instead.
        mixed_precision: compute and communicate in this dtype (``torch.bfloat16``),
            keeping fp32 master shards and optimizer state.
        reduce_dtype: reduce gradients in this dtype (default: ``mixed_precision``).
        reduce_in_backward: stages 1-2 reduce each bucket as backward fills it (the
            overlap); False leaves the gradients in ``.grad`` for :meth:`reduce_gradients`
            (a composed job whose ``finalize_grads`` sums tensor-parallel partial
            gradients first; a pipeline's many backwards). Stage 3 always reduces units
            in backward.
        **optimizer_kwargs: defaults for every group, passed to ``optimizer_class``.

    ``param_groups`` are the groups given (with every default filled in): an LR
    scheduler, or a write to ``param_groups[i]["lr"]``, takes effect at the next
    :meth:`step`, which copies every group's options to the inner optimizer
    (``self.optimizer``, whose ``state`` is also :attr:`state`: this rank's pieces).
    Weights written into the model (``model.load_state_dict``) are noticed at the next
    step and become the masters' values (stage 3: at the next forward, also after
    ``assign=True``; stages 1-2: build the optimizer after an ``assign=True`` load, as
    for any torch optimizer); load them on every rank.

    Raises:
        ValueError: a stage other than 1-3, a parameter passed twice, mixed dtypes,
            shards of a sharded model below stage 3 or plain parameters at stage 3.
        TypeError: a group that is not a dict with ``"params"``.

    Example::

        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = ZeroOptimizer([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            torch.optim.AdamW, stage=2, lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        opt.zero_grad(); loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); sched.step()
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 stage: int = 1, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, mixed_precision: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, reduce_in_backward: bool = True,
                 **optimizer_kwargs: Any):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3 (got {stage!r})")
        groups = normalize_groups(params)
        members = [group_tensors(g) for g in groups]
        self._shards, group_of = _build_shards(members, stage, process_group, bucket_cap_mb,
                                               mixed_precision, reduce_dtype,
                                               reduce_in_backward)
        self.pieces: list[Piece] = plan_pieces(self._shards.layout, group_of)
        self.piece_params = self._make_piece_params()
        # Which of ``params`` each group holds (by index), and its pieces on this rank.
        self.group_params = [[i for i, g in enumerate(group_of) if g == n]
                             for n in range(len(groups))]
        inner_groups = [{**options(group), "params": self._pieces_of(n)}
                        for n, group in enumerate(groups)]
        self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        self._frozen = False
        super().__init__(groups, dict(self.optimizer.defaults))
        self._frozen = True  # the layout is fixed: no group can be added later
        self.state = self.optimizer.state
        self.state_offload: UnitOffload | None = None  # ZeRO-Offload: offload_states
        self.offload = getattr(self._shards, "offload", None)
        # How step() steps the shards, chosen once: here, on the masters in memory
        self._step_shards: Callable[[], None] = lambda: step_on_masters(
            self.optimizer, self.piece_params, self._piece_grads())
        if self.offload is not None:  # stage 3 offloaded: each unit steps in backward
            self.offload.stepper = unit_stepper(self.optimizer, self.pieces,
                                                self.piece_params, self._copy_options,
                                                self.offload.state_fields)
            self._step_shards = lambda: None  # every unit stepped in backward already

    def _make_piece_params(self) -> list[nn.Parameter]:
        """The inner optimizer's parameters: each piece of a master shard (the shard
        itself when one piece covers it, so a single group steps whole shards)."""
        out = []
        for piece in self.pieces:
            shard = self._shards.shard_params[piece.bucket]
            whole = piece.start == 0 and piece.stop == shard.numel()
            out.append(shard if whole else nn.Parameter(shard.detach()[piece.start : piece.stop]))
        return out

    def _pieces_of(self, group: int) -> list[nn.Parameter]:
        return [q for q, piece in zip(self.piece_params, self.pieces, strict=True)
                if piece.group == group]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while constructing: the shard layout of every parameter is fixed then.

        Raises:
            RuntimeError: after construction (build a new ZeroOptimizer instead).
        """
        if self._frozen:
            raise RuntimeError("ZeroOptimizer.add_param_group: parameters are laid out in "
                               "shards when the optimizer is built; build a new "
                               "ZeroOptimizer with every group instead")
        super().add_param_group(param_group)

    # -- what the stage machinery holds ---------------------------------------------------------

    @property
    def stage(self) -> int:
        return self._shards.stage

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._shards.group

    @property
    def world(self) -> int:
        return self._shards.world

    @property
    def rank(self) -> int:
        return self._shards.rank

    @property
    def precision(self) -> Precision:
        return self._shards.precision

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter, in layout index order (stage 3: the original parameters)."""
        return self._shards.params

    @property
    def layout(self) -> Any:
        return self._shards.layout

    @property
    def shard_params(self) -> list[nn.Parameter]:
        """This rank's master shard of each bucket (stage 3: unit), in layout order."""
        return self._shards.shard_params

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient of each bucket (stage 3: unit)."""
        return self._shards.shard_grads

    def param_shapes(self) -> list[torch.Size]:
        """The shape of each of :attr:`params` (checkpoints)."""
        return self._shards.param_shapes()

    def param_names(self, model: nn.Module) -> list[str]:
        """The qualified name in ``model`` of each of :attr:`params` (checkpoints)."""
        return self._shards.param_names(model)

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step on this rank's pieces with each group's current options, then publish the
        new values (stages 1-2: all-gather them into every rank's parameters; stage 3:
        the next forward gathers them). Returns ``closure()``'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._shards.adopt_model_writes()
        self._copy_options()
        self._step_shards()
        self._shards.publish_shards()
        return loss

    def offload_states(self, config: OffloadConfig) -> None:
        """ZeRO-Offload (stages 1-2): keep the optimizer state of every bucket's shard
        in a unit store (``config``: files or host memory, read ``prefetch`` buckets
        ahead), stepped bucket by bucket; the master shards stay in memory. Call it
        before the first step.

        Raises:
            ValueError: at stage 3 (offload its units instead: ``shard_model(...,
                offload=...)``), after a step, or for an optimizer whose state is not
                per element.
        """
        if self.stage == 3:
            raise ValueError("ZeroOptimizer.offload_states: stage 3 offloads whole units "
                             "(shard_model(..., offload=OffloadConfig(...)))")
        if any(self.optimizer.state.values()):
            raise ValueError("ZeroOptimizer.offload_states: call it before the first step")
        fields, _ = optimizer_state_layout(type(self.optimizer), dict(self.optimizer.defaults))
        spans = [Span(k, shard.numel()) for k, shard in enumerate(self.shard_params)]
        master = self.shard_params[0] if self.shard_params else torch.empty(0)
        self.state_offload = UnitOffload(replace(config, state_fields=fields), spans,
                                         master.dtype, master.device,
                                         dist.get_rank(), masters=False)
        self.state_offload.stepper = unit_stepper(self.optimizer, self.pieces,
                                                  self.piece_params, self._copy_options,
                                                  fields)
        store = self.state_offload  # bucket by bucket, each bucket's state from the store
        self._step_shards = lambda: store.step_states(list(self.shard_params),
                                                      self._shards.shard_grads)

    def reduce_gradients(self) -> None:
        """Reduce the gradients backward left in ``.grad`` (built with
        ``reduce_in_backward=False``, as a composed job's ``finalize_grads`` does: after
        the tensor-parallel partial sums). Stage 3 reduces each unit in backward."""
        if self.stage == 3:
            return
        self._shards.reduce_gradients()  # type: ignore[union-attr]

    def _copy_options(self) -> None:
        """The groups' options (an LR scheduler writes them) into the inner optimizer."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update(options(outer))

    def _piece_grads(self) -> list[torch.Tensor]:
        grads = self._shards.shard_grads
        return [grads[p.bucket] if q is self.shard_params[p.bucket] else
                grads[p.bucket][p.start : p.stop] for p, q in zip(self.pieces, self.piece_params,
                                                                   strict=True)]

    def publish_shards(self) -> None:
        """Every rank's master shards into the parameters (after writing the masters)."""
        self._shards.publish_shards()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: every parameter's ``.grad`` (the groups', stage 3's original
        parameters' and this rank's pieces') becomes None, or is zeroed in place if it
        exists; the reduced gradients are zeroed either way, and the next backward
        overwrites them (instead of accumulating)."""
        self._shards.zero_grad()
        super().zero_grad(set_to_none)
        for p in [*self.params, *self.piece_params]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def no_sync(self) -> AbstractContextManager[Any]:
        """Stage 1 only: accumulate whole gradients locally; the next backward outside
        reduces the sum (stages 2 and 3 reduce every backward: they keep no whole
        gradients)."""
        return self._shards.no_sync()

    def grad_parts(self) -> list[tuple[int, torch.Tensor]]:
        """(index in :attr:`params`, the part of this rank's reduced gradient that is that
        parameter's), for every parameter this rank owns elements of."""
        self._refuse_offload("grad_parts (and clip_grad_norm_)")
        parts = []
        layout, grads = self.layout, self.shard_grads
        for k, bucket in enumerate(layout.buckets):
            mine = bucket.shard_of(layout.rank)
            for i in bucket.params:
                lo = max(layout.offsets[i], mine.start)
                hi = min(layout.offsets[i] + layout.numels[i], mine.stop)
                if lo < hi:
                    parts.append((i, grads[k][lo - mine.start : hi - mine.start]))
        return parts

    def clip_grad_norm_(self, max_norm: float, model_parallel_group: Any = None) -> torch.Tensor:
        """Clip by the global 2-norm of the model's gradient; returns that norm.

        The norm is summed over the data-parallel group's shards and over the model-
        parallel ranks: by default the tensor-parallel group that
        :func:`pycomm.parallel.tensor.apply_tensor_parallel` recorded on the parameters, where a
        split parameter counts every rank's part and a replicated one counts once.
        A pipeline (whose stages hold different parameters) passes the group of every
        tensor- and pipeline-parallel rank as ``model_parallel_group`` (Megatron's
        ``get_model_parallel_group()``).
        """
        weighted = torch.zeros((), dtype=torch.float64)
        for i, part in self.grad_parts():
            copies = replicated_copies(self.params[i])
            weighted += sum_of_squares(part) / copies
        total = weighted.reshape(1)
        dist.all_reduce(total, group=self.group)
        for group in model_parallel_groups(self.params, model_parallel_group):
            dist.all_reduce(total, group=group)
        norm = total[0].sqrt()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in self.shard_grads:
                g.mul_(coef)
        return norm.to(self.precision.master)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, to resume at the same world size, stage and layout:
        the inner optimizer's state of this rank's pieces (step counts included), the
        fp32 master shards under mixed precision at stages 1-2 (elsewhere the masters
        are the model's own parameters: save ``model.state_dict()`` beside it), and
        every group's options. Tensors are references, as torch's are: save it (one
        file per rank) or copy it before training on.

        To resume on another world size, or to get a plain full model, use
        :func:`pycomm.parallel.zero.save_sharded` / :func:`load_sharded` / :func:`consolidate`
        instead: they store each parameter whole, as every rank's chunks of it
        (torch.distributed.checkpoint), by parameter name.
        """
        self._refuse_offload("state_dict", state_only=True)
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._shards.adopt_model_writes()  # masters of weights loaded since the last step
        masters = None if self._shards.masters_in_model else [m.detach()
                                                                for m in self.shard_params]
        state = {
            **self._signature(),
            "param_groups": [{**options(g), "params": list(ids)}
                             for g, ids in zip(self.param_groups, self.group_params, strict=True)],
            "inner": self.optimizer.state_dict(),
            "masters": masters,
        }
        for post in self._optimizer_state_dict_post_hooks.values():
            state = post(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank (before or after loading
        the model's weights). Collective under mixed precision at stages 1-2 (the
        loaded masters are all-gathered into the parameters): call it on every rank.

        Raises:
            ValueError: the state is not a ZeroOptimizer's, or is from another world size,
                rank, stage, precision, optimizer class, layout or grouping.
        """
        self._refuse_offload("load_state_dict", state_only=True)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        optimizer_state.check(self._signature(), state_dict)
        self.optimizer.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(options(saved))
        self._copy_options()
        if state_dict["masters"] is not None:
            with torch.no_grad():
                for mine, saved in zip(self.shard_params, state_dict["masters"], strict=True):
                    mine.copy_(saved)
            self.publish_shards()
            self._shards.adopt_model_writes()  # what publishing wrote is the optimizer's own
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _refuse_offload(self, what: str, state_only: bool = False) -> None:
        """Stage 3 offloaded keeps no gradient or state in memory; ZeRO-Offload (stages
        1-2) no state (``state_only``: what reads only gradients runs there)."""
        if self.offload is not None:
            raise RuntimeError(f"ZeroOptimizer.{what}: offloaded units step in backward, as "
                               "soon as their gradient is reduced; no gradient or state "
                               "stays in memory to clip, measure or save")
        if self.state_offload is not None and state_only:
            raise RuntimeError(f"ZeroOptimizer.{what}: the optimizer state is in the unit "
                               "store (offload_states); save through the composed engine's "
                               "checkpoints (pycomm.parallel.compose), which stream it")

    def _signature(self) -> dict[str, Any]:
        return optimizer_state.signature(self.stage, self.world, self.rank, self.precision,
                                         self.optimizer, self.layout, self.pieces,
                                         self.group_params)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for parameters (compute dtype), fp32 master shards
        (mixed precision), reduced gradients, optimizer state and buckets (stage 3:
        pooled whole-unit buffers, and their peak)."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return self._shards.memory_stats(state)


def _build_shards(members: list[list[torch.Tensor]], stage: int,
                  process_group: dist.ProcessGroup | None, bucket_cap_mb: float,
                  mixed_precision: torch.dtype | None, reduce_dtype: torch.dtype | None,
                  reduce_in_backward: bool = True,
                  ) -> tuple[FlatShards | Stage3Shards, list[int]]:
    """The stage's machinery, and the group of each of its parameters (layout index)."""
    if stage == 3:
        engine = engine_of([p for tensors in members for p in tensors])
        group_of = group_of_params(engine, members)
        precision = Precision.choose(engine.dtype, mixed_precision, reduce_dtype)
        return Stage3Shards(engine, process_group, precision), group_of
    params = check_params([p for tensors in members for p in tensors])
    master = params[0].dtype if params else torch.float32
    precision = Precision.choose(master, mixed_precision, reduce_dtype)
    group_of = [n for n, tensors in enumerate(members) for _ in tensors]
    shards = FlatShards(params, stage, process_group, bucket_cap_mb, precision,  # type: ignore[arg-type]
                        reduce_in_backward)
    return shards, group_of
