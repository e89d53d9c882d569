"""The composed engine: this rank's part of the model, its optimizer, and the steps that
train it (built by :func:`pycomm.parallel.compose.parallelize`, which documents the order)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpointing import parallel_model
from ..mesh import ParallelMesh
from ..pipeline.forward_only import forward_loss
from ..pipeline.microbatch import split_batch
from ..pipeline.pipeline import Pipeline
from ..plans.plan import ModelInputs, Plan
from ..precision import widened
from ..recompute.from_plan import checkpoint_units
from ..rng import seed_streams
from ..tensor import comms
from ..tensor.from_plan import partial_grad_params
from ..tensor.sharding import mark_tensor_parallel_group, spec_of
from ..zero.plan_units import zero3_units
from . import stage as build
from .apply_ep import expert_parallel, is_expert
from .apply_tiles import tile_large_layers
from .batch import check_targets, model_inputs, vocab_of
from .batch_layers import batchnorm_over_batch, expert_capacity, routing_stats
from .compiled import compile_blocks
from .config import ParallelConfig, StepResult
from .expert_side import ExpertsBeside
from .finalize import (
    GradPhases,
    clip_coefficient,
    clip_grad_norm_,
    finalize_grads,
)
from .generate import Sampling, generate
from .loss import StepLoss, not_ignored
from .loss_scale import LossScaler
from .naming import ParamNames
from .plain_dp import PlainDataParallel
from .pretrained import load_pretrained
from .tied import CrossStageTies
from .zero_side import ZeroPlan

_PAIR_WITH_OFFLOAD = ("parallelize: loss_fn returned a (sum, count) pair, but offload steps "
                      "each unit in backward, before the step's count is known; return the "
                      "mean loss with offload")


def _model_dtype(model: nn.Module) -> torch.dtype:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return max(set(floats), key=floats.count) if floats else torch.float32


class ParallelModel:
    """This rank's part of the model, its optimizer, and the steps that train it."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, config: ParallelConfig,
                 plan: Plan):
        self.mesh, self.config, self.plan, self.model = mesh, config, plan, model
        self.tp_group = mesh.group("tp")
        self.compute = config.compute_dtype(_model_dtype(model))
        self.master = torch.float64 if self.compute == torch.float64 else torch.float32
        self.vocab = vocab_of(model, plan)  # before the head is split or dropped
        self.last_tokens = 0  # the last step's count of targets the loss counted
        self.last_aux = 0.0  # and its load-balancing loss
        self._loss: StepLoss | None = None  # the step's, while it runs
        self.vocab_bounds: list[tuple[int, int]] | None = None  # a tiled head's chunks
        self.stage_plan = self._build_stage(model)
        self._build_pipeline(model)
        batchnorm_over_batch(self)
        self.routing = routing_stats(self)
        self.drops = expert_capacity(self, model)
        # After the weights exist: torch's generator then differs per pipeline stage.
        seed_streams(config.seed, mesh.rank("tp"), mesh.rank("pp"))
        self.ties = CrossStageTies(self.stage_plan.ties, self.stage_plan.stage_of, mesh)
        self._build_data_side(model)
        if config.compile:
            compile_blocks(self.stage_plan)
        self.optimizer = self.dp.optimizer
        lam = config.lr_lambda or (lambda _step: 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lam)
        self.scaler = (LossScaler(config.loss_scale, config.loss_scale_window)
                       if self.compute == torch.float16 else None)

    # -- building ------------------------------------------------------------------------------

    def _build_stage(self, model: nn.Module) -> build.Stage:
        stage = build.plan_stage(model, self.plan, self.mesh, self.config.seed)
        build.drop_other_stages(model, stage)
        if self.mesh.size("tp") > 1:
            build.tensor_parallel(model, self.plan, stage, self.mesh,
                                  self.config.sequence_parallel, self.config.loss_fn is None)
        if self.mesh.size("ep") > 1:
            expert_parallel(model, self.plan, stage.held, self.mesh.group("ep"),
                            stage.materializer)
        build.materialize_rest(model, stage, but_zero3=self.config.zero == 3)
        build.tie_here(model, stage)
        build.cast(model, stage, self.master)
        return stage

    def _build_pipeline(self, model: nn.Module) -> None:
        stage = self.stage_plan
        splits = build.sequence_splits(stage, self.mesh, self.config.sequence_parallel)
        layers = build.stage_modules(model, self.plan, stage, splits)
        self.pipeline = Pipeline(layers, stage.balance, self.config.microbatches,
                                 checkpoint="never", schedule=self.config.schedule,
                                 process_group=self.mesh.group("pp"))
        self.stage = self.pipeline.stage
        if self.mesh.size("tp") > 1:
            mark_tensor_parallel_group(self.stage, self.tp_group)
        if self.config.recompute:
            group = self.tp_group if self.config.partition_activations else None
            checkpoint_units(self.plan, stage, group)

    def _copies(self, p: nn.Parameter) -> int:
        """Ranks of one data-parallel replica that hold this same gradient."""
        tp = self.mesh.size("tp") if spec_of(p).dim is None else 1
        return tp * self.ties.copies(self.names.of(p))

    def _build_data_side(self, model: nn.Module) -> None:
        config, stage = self.config, self.stage_plan
        self.names = ParamNames(model, stage, self.stage, stage.canonical)
        partial = partial_grad_params(list(self.stage.parameters()))
        if partial and config.zero == 3:
            # Stage 3 reduces each unit in backward: partial gradients must be whole by
            # then, so they are summed as they arrive rather than at phase 1.
            for p in partial:
                p.register_hook(lambda grad: comms.all_reduce(grad.clone(), self.tp_group))
            partial = []
        if config.zero == 0:
            params = [p for p in self.stage.parameters() if p.requires_grad]
            self.dp: Any = PlainDataParallel(params, self.mesh, config, self.compute, self._copies)
        else:
            units, keep = zero3_units(self.plan, stage, self.ties, self.names,
                                      own_large_layers=config.offload != "none")
            tiles = self._tiles(model)
            units, keep = units + tiles, keep + self._paths_in(tiles)
            experts = {n for n, p in self.stage.named_parameters() if is_expert(p)}
            # a tie across stages is summed after backward: offloaded units wait for it
            self.dp = ZeroPlan(self.stage, self.mesh, config, self.compute, self._copies,
                               units, keep, self.names.materialize_by_stage_name, experts,
                               defer=bool(self.ties.ties))
            if experts:
                self.dp = ExpertsBeside(self.dp, self._experts_side(experts))
        self.names.refresh(self.stage)
        self.params: list[nn.Parameter] = list(self.dp.params)
        tied = self.ties.mine(self.names.by_id(), self.params)
        self.phases = GradPhases(
            tp_partial=partial, tp_group=self.tp_group, data_parallel=self.dp.reduce,
            grad_parts=self.dp.grad_parts,
            pipeline_before=(lambda: self._sum_ties(tied, before=True)),
            pipeline_after=(lambda: self._sum_ties(tied, before=False)))

    def _tiles(self, model: nn.Module) -> list[nn.Module]:
        """``max_unit_bytes``: this stage's large layers as tiles (stage 3's units)."""
        if self.config.max_unit_bytes is None:
            return []
        made = tile_large_layers(model, self.stage_plan,
                                 self.config.max_unit_bytes // self.master.itemsize)
        self.vocab_bounds = made.head_bounds
        self.names.refresh(self.stage)
        return made.units

    def _paths_in(self, modules: list[nn.Module]) -> tuple[str, ...]:
        """The stage paths of ``modules``' parameters (units whatever their size)."""
        ids = {id(p) for m in modules for p in m.parameters()}
        return tuple(n for n, p in self.stage.named_parameters() if id(p) in ids)

    def _experts_side(self, experts: set[str]) -> Any:
        """The experts beside ZeRO: their own ZeRO over the ranks holding the same experts
        (``edp``; stage 3 as stage 2: they are gathered by dispatch, not by ZeRO), whole
        where no other rank holds them."""
        config, mesh = self.config, self.mesh
        if mesh.size("edp") == 1:
            beside = [p for p in self.stage.parameters() if is_expert(p)]
            return PlainDataParallel(beside, mesh, config, self.compute, self._copies)
        dense = {n for n, _ in self.stage.named_parameters()} - experts
        return ZeroPlan(self.stage, mesh, config, self.compute, self._copies, exclude=dense,
                        axis="edp", stage=min(config.zero, 2),
                        grad_scale=mesh.size("edp") / mesh.size("dp"))

    def _sum_ties(self, tied: list[tuple[nn.Parameter, Any]], before: bool) -> None:
        """Phase 3 (see :mod:`pycomm.parallel.compose.finalize`): before the data-parallel
        reduction on whole gradients, or after it on ZeRO-3's shards."""
        if not tied or before == (self.config.zero == 3):
            return
        if before:
            grads = []
            for p, group in tied:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append((p.grad, group))
            self.ties.sum_grads(grads)
        else:  # in the shards, or offloaded in the units' records
            self.dp.sum_tied_shards(tied, self.ties.sum_grads)

    # -- steps ---------------------------------------------------------------------------------

    def _rows(self, batch: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """This data-parallel replica's rows of the global batch (``whole``: all of it)."""
        dp, rank = self.mesh.size("dp"), self.mesh.rank("dp")
        if whole:
            dp, rank = 1, 0
        if batch.shape[0] % dp:
            raise ValueError(f"parallelize: a batch of {batch.shape[0]} rows cannot be split "
                             f"over dp={dp} replicas")
        per = batch.shape[0] // dp
        rows = batch[rank * per : (rank + 1) * per]
        return rows.to(self.compute) if rows.is_floating_point() else rows

    def _step_loss(self, targets: torch.Tensor) -> StepLoss:
        """This step's loss function (see :mod:`pycomm.parallel.compose.loss`)."""
        check_targets(targets, self.config, self.vocab)
        return StepLoss(custom=self.config.loss_fn, ignore_index=self.config.ignore_index,
                        tp_group=self.tp_group if self.stage_plan.split_logits else None,
                        replicas=self.mesh.size("dp"),
                        global_count=not_ignored(targets, self.config.ignore_index),
                        elements=targets.numel(),
                        replica_rows=targets.shape[0] // self.mesh.size("dp"),
                        vocab_bounds=self.vocab_bounds,
                        pair_refusal=_PAIR_WITH_OFFLOAD if self.config.offload != "none" else "")

    def loss_fn(self, output: Any, targets: torch.Tensor) -> Any:
        """The plan's logits of ``output`` in fp32 or wider, given to this step's loss."""
        logits = self.plan.output(output) if self.plan.output is not None else output
        assert self._loss is not None, "loss_fn is called inside a step"
        if logits.is_floating_point() and not self._loss.chunked:  # chunks widen one at a time
            logits = widened(logits)
        return self._loss(logits, targets)

    def _use_inputs(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, whole: bool = False) -> None:
        """The batch's model inputs, each micro-batch's set before its forward and backward
        (see ``Pipeline.before_micro``)."""
        given = model_inputs(tokens, attention_mask, position_ids, self.plan)
        context = self.stage_plan.context
        if context is None:
            return
        if given is None:
            context.set_inputs(None)
            self.pipeline.before_micro = None
            return
        rows = {k: self._rows(v, whole) for k, v in given.given().items()}
        micro = split_batch(rows, self.config.microbatches)
        batches = [ModelInputs(**m) for m in micro]
        self.pipeline.before_micro = lambda m: context.set_inputs(batches[m])

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor,
                   attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on the global batch (the same on every rank); returns its
        loss (that of one process on the whole batch: targets equal to
        ``config.ignore_index`` are not counted) and the gradient norm, on every rank.
        ``attention_mask`` and ``position_ids`` (``(batch, seq)``, HuggingFace's
        conventions, see :class:`~pycomm.parallel.plans.plan.ModelInputs`) go to the model
        where the plan takes them. Under fp16 a step whose gradients overflowed is
        skipped (``skipped``), on every rank."""
        scale = self.scaler.scale if self.scaler else 1.0
        loss = self.compute_gradients(tokens, targets, scale, attention_mask, position_ids)
        dropped = self.drops.total() if self.drops is not None else 0
        parts = self.phases.grad_parts()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scaler is not None:
            if self.scaler.overflowed(parts):
                self.scaler.update(True)
                self.dp.zero_grad()
                return StepResult(loss, float("inf"), lr, True, scale, self.last_tokens,
                                  self.last_aux, dropped)
            self.scaler.unscale(parts)
        norm = clip_grad_norm_(parts, self.config.max_grad_norm)
        if self.config.offload != "none":  # deferred: the units step now, from their records
            unscale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            self.dp.step_offloaded(unscale, clip_coefficient(norm, self.config.max_grad_norm))
        self.optimizer.step()
        self.dp.after_step()
        self.scheduler.step()
        if self.scaler is not None:
            self.scaler.update(False)
        return StepResult(loss, norm, lr, False, scale, self.last_tokens, self.last_aux,
                          dropped)

    def compute_gradients(self, tokens: torch.Tensor, targets: torch.Tensor,
                          loss_scale: float = 1.0, attention_mask: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None) -> float:
        """Forward and backward of every micro-batch, then :func:`finalize_grads`: the
        step's complete gradients, not yet clipped or applied. Returns the loss."""
        self.stage.train()
        self.dp.zero_grad()
        self.pipeline.loss_scale = loss_scale
        self._loss = self._step_loss(targets)
        self._use_inputs(tokens, attention_mask, position_ids)
        if self.routing is not None:
            self.routing.reset()
        if self.drops is not None:
            self.drops.reset()
        shares = self.pipeline.step(self._rows(tokens), self._rows(targets), self.loss_fn,
                                    loss_is_mean=False)
        finalize_grads(self.phases)
        factor, self.last_tokens = self._loss.finish(self._counts_loss())
        if factor != 1.0:
            for g, _ in self.phases.grad_parts():
                g.mul_(factor)
        self.last_aux = self.routing.loss() if self.routing is not None else 0.0
        return self._dp_mean(shares) * factor + self.last_aux

    def _counts_loss(self) -> bool:
        """Whether this rank's loss counts add up to the global count (one per replica)."""
        return self.pipeline.is_last and self.mesh.rank("tp") == 0

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> float:
        """The loss of the global batch (as :meth:`train_step` counts it), without
        gradients."""
        self.stage.eval()
        self._loss = self._step_loss(targets)
        self._use_inputs(tokens, attention_mask, position_ids)
        if self.routing is not None:
            self.routing.reset()
        if self.drops is not None:
            self.drops.reset()
        shares = forward_loss(self.pipeline, self._rows(tokens), self._rows(targets),
                              self.loss_fn, loss_is_mean=False)
        factor, _ = self._loss.finish(self._counts_loss())
        aux = 0.0
        if self.routing is not None:
            self.routing.finish()
            aux = self.routing.loss()
        return self._dp_mean(shares) * factor + aux

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The whole batch's logits (fp32, the whole vocabulary), on every rank: what the
        unsplit model computes (an export's reload is checked against it). A batch whose
        rows do not split over the replicas is computed whole by each."""
        self.stage.eval()
        whole = tokens.shape[0] % self.mesh.size("dp") != 0
        self._use_inputs(tokens, attention_mask, position_ids, whole)
        caught: list[torch.Tensor] = []

        def keep(output: Any, _targets: Any) -> torch.Tensor:
            logits = self.plan.output(output) if self.plan.output is not None else output
            caught.append(widened(logits))
            return torch.zeros(())

        rows = self._rows(tokens, whole)
        forward_loss(self.pipeline, rows, rows, keep)
        mine = torch.cat(caught) if caught else torch.empty(0)
        if self.stage_plan.split_logits:
            mine = comms.gather_dim(mine, mine.dim() - 1, self.tp_group)
        return self._everywhere(mine, rows.shape[0], gather=not whole)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int,
                 attention_mask: torch.Tensor | None = None, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
                 eos_token_id: int | None = None, pad_token_id: int | None = None
                 ) -> torch.Tensor:
        """``tokens`` and up to ``max_new_tokens`` more, greedy or sampled, the same on
        every rank and the one-process model's (:mod:`pycomm.parallel.compose.generate`);
        collective."""
        sampling = Sampling(do_sample, temperature, top_k, seed)
        return generate(self, tokens, max_new_tokens, attention_mask, sampling, eos_token_id,
                        pad_token_id)

    def _everywhere(self, mine: torch.Tensor, rows: int, gather: bool = True) -> torch.Tensor:
        """The last stage's rows of every replica (``gather``; else of this one), on
        every rank."""
        shape: list[Any] = [None, None]
        if self.pipeline.is_last:
            shape = [[rows, *mine.shape[1:]], str(mine.dtype).removeprefix("torch.")]
        last = dist.get_global_rank(self.mesh.group("pp"), self.mesh.size("pp") - 1)
        dist.broadcast_object_list(shape, src=last, group=self.mesh.group("pp"))
        full = torch.empty(shape[0], dtype=getattr(torch, shape[1]))
        if self.pipeline.is_last:
            full.copy_(mine)
        dist.broadcast(full, src=last, group=self.mesh.group("pp"))
        return comms.gather_dim(full, 0, self.mesh.group("dp")) if gather else full

    def _dp_mean(self, loss: torch.Tensor | float) -> float:
        value = torch.as_tensor(loss).detach().double().reshape(1).clone()
        dist.all_reduce(value, group=self.mesh.group("dp"))
        return float(value) / self.mesh.size("dp")

    def stage3_stats(self) -> dict[str, Any]:
        """This rank's ZeRO-3 counters ({} below stage 3): the gathered-unit pool's bytes
        (``pool_peak_bytes``), gathers and prefetches held back by the live budget, and
        offloaded, the unit store's I/O (bytes read and written, waits, the records held
        at most)."""
        zero3 = self.stage.__dict__.get("zero3")
        if zero3 is None:
            return {}
        pool = zero3.pool.stats()
        out = {**zero3.stats, "pool_peak_bytes": pool["peak_bytes"],
               "pool_peak_reserved_bytes": pool["peak_reserved_bytes"]}
        if zero3.offload is not None:
            out.update(zero3.offload.io_stats())
        return out

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (tensor-parallel parts; under ZeRO-3 the originals,
        empty between uses)."""
        return self.params

    # -- checkpoints (torch.distributed.checkpoint: each rank its pieces, any layout) -----

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        """Write parameters, optimizer and scheduler state and ``extra``; collective."""
        parallel_model.save(self, directory, extra)

    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written in any layout; returns its ``extra``; collective."""
        return parallel_model.load(self, directory)

    def load_pretrained(self, directory: str) -> int:
        """This rank's pieces of HuggingFace safetensors weights (``save_pretrained``'s
        folder) into the parameters, read piece by piece; returns the elements read;
        collective (:mod:`pycomm.parallel.compose.pretrained`)."""
        return load_pretrained(self, directory)
