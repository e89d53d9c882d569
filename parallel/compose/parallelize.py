"""Every strategy at once, applied in one fixed order to the reference GPT on a mesh.

As torchtitan's ``parallelize_*``: the model is built whole on every rank from one seed
(so every layout starts from the same weights), then, in this order,

1. **pipeline split**: this rank keeps its stage's layers (``pp``);
2. **tensor parallel** (+ sequence parallelism): the stage's blocks, embedding and head
   become Megatron's parallel layers over the ``tp`` group;
3. **activation checkpointing** (+ ``P_a``, which partitions the kept block inputs over
   ``tp``): each block recomputed in backward, every random stream replayed;
4. **data parallel or ZeRO** over the ``dp`` group.

A step then runs the pipeline's schedule over micro-batches, completes the gradients in
:func:`parallel.compose.finalize.finalize_grads`'s fixed phases, clips by the norm over the
whole mesh, and steps the optimizer. The global batch is the same on every rank; each
data-parallel replica takes its own rows, so a layout trains the same model as one
process on the whole batch.

Example::

    mesh = ParallelMesh(pp=2, dp=2, tp=2)
    engine = parallelize(GPT(cfg), mesh, ParallelConfig(zero=1, sequence_parallel=True))
    loss, grad_norm = engine.train_step(tokens, targets)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.compose import checkpoint
from parallel.compose.dp_plan import build_data_parallel
from parallel.compose.finalize import GradPhases, clip_grad_norm_, finalize_grads
from parallel.compose.gpt_layers import (
    EmbeddingLayer,
    HeadLayer,
    gpt_layers,
    model_name,
    stage_balance,
)
from parallel.compose.mesh import ParallelMesh
from parallel.models import GPT, Block, lm_loss
from parallel.pipeline.forward_only import forward_loss
from parallel.pipeline.pipeline import Pipeline
from parallel.recompute.apply import checkpoint_module
from parallel.rng import seed_streams
from parallel.tensor.apply import (
    parallelize_block,
    parallelize_embedding,
    parallelize_head,
    partial_grad_params,
    sum_partial_grads_on_arrival,
)
from parallel.tensor.layers import vocab_parallel_cross_entropy
from parallel.tensor.sharding import mark_tensor_parallel_group


@dataclass
class ParallelConfig:
    """How to parallelize (the mesh's sizes come from the mesh).

    Args:
        sequence_parallel: split activations along the sequence between TP layers.
        zero: 0 for data parallelism, 1-3 for that ZeRO stage over ``dp``.
        recompute: checkpoint every block (activations recomputed in backward).
        partition_activations: ``P_a``: each TP rank keeps 1/TP of a checkpointed block's
            input (needs ``recompute``; not with sequence parallelism).
        microbatches: micro-batches per step (the pipeline's M; 1 without a pipeline).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        optimizer: the ``torch.optim`` class, and ``optimizer_kwargs`` its arguments.
        weight_decay: applied to matrices only (biases, norms: none), as GPT recipes do.
        lr_lambda: multiplies the learning rate at each step (a warmup/decay schedule).
        bucket_mb: gradient bucket size (C_B).
        seed: seeds the random streams (dropout) for this rank's place in the mesh
            (parallel.rng: replicated across TP ranks or per TP rank, per stage).
    """

    sequence_parallel: bool = False
    zero: int = 0
    recompute: bool = False
    partition_activations: bool = False
    microbatches: int = 1
    schedule: str = "1f1b"
    max_grad_norm: float | None = 1.0
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW
    optimizer_kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})
    weight_decay: float = 0.0
    lr_lambda: Callable[[int], float] | None = None
    bucket_mb: float = 25
    seed: int = 0

    def check(self, mesh: ParallelMesh) -> None:
        """Raises ValueError for combinations that cannot work, naming them."""
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallelize: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.partition_activations and not self.recompute:
            raise ValueError("parallelize: partition_activations (P_a) partitions the inputs "
                             "kept by activation checkpointing; set recompute=True")
        if self.partition_activations and self.sequence_parallel:
            raise ValueError("parallelize: partition_activations (P_a) with sequence "
                             "parallelism: a block's input is already split along the "
                             "sequence (different on each TP rank), so it cannot be "
                             "partitioned again; use one of them (Megatron-LM refuses this too)")
        if self.sequence_parallel and mesh.size("tp") == 1:
            raise ValueError("parallelize: sequence_parallel needs tp > 1")
        if self.microbatches < 1:
            raise ValueError(f"parallelize: microbatches must be >= 1, got {self.microbatches}")


@dataclass
class StepResult:
    loss: float  # the mean loss over the global batch
    grad_norm: float  # before clipping
    lr: float


def parallelize(model: GPT, mesh: ParallelMesh, config: ParallelConfig) -> ParallelModel:
    """Apply every strategy of ``config`` to ``model`` on ``mesh`` (see the module
    docstring for the order). Collective over the world; ``model`` must hold the same
    weights on every rank."""
    config.check(mesh)
    return ParallelModel(model, mesh, config)


class ParallelModel:
    """This rank's part of the model, its optimizer, and the steps that train it."""

    def __init__(self, model: GPT, mesh: ParallelMesh, config: ParallelConfig):
        self.mesh, self.config, self.cfg = mesh, config, model.cfg
        self.tp_group = mesh.group("tp")
        layers = gpt_layers(model)
        self.n_blocks = len(model.blocks)
        balance = stage_balance(self.n_blocks, mesh.size("pp"))
        self.pipeline = Pipeline(layers, balance, config.microbatches, checkpoint="never",
                                 schedule=config.schedule, process_group=mesh.group("pp"))
        self.stage = self.pipeline.stage
        if mesh.size("tp") > 1:
            self._tensor_parallel()
        if config.recompute:
            self._checkpoint_blocks()
        # After the weights exist: torch's generator then differs per pipeline stage.
        seed_streams(config.seed, mesh.rank("tp"), mesh.rank("pp"))
        self.names = self._model_names()
        # The parameters as built (ZeRO-3 then replaces the stage's with shards).
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.shapes = {id(p): p.shape for p in self.params}
        partial = partial_grad_params(self.stage) if config.sequence_parallel else []
        if partial and config.zero == 3:
            # Stage 3 reduces each unit in backward: partial gradients must be whole by
            # then, so they are summed as they arrive rather than at phase 1.
            sum_partial_grads_on_arrival(self.stage, self.tp_group)
            partial = []
        self.dp = build_data_parallel(self.stage, self.params, mesh, config)
        self.phases = GradPhases(
            tp_partial=partial, tp_group=self.tp_group, data_parallel=self.dp.reduce,
            grad_parts=self.dp.grad_parts)
        self.optimizer = self.dp.optimizer
        lam = config.lr_lambda or (lambda _step: 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lam)

    # -- building ------------------------------------------------------------------------------

    def _tensor_parallel(self) -> None:
        sp = self.config.sequence_parallel
        for layer in self.stage:
            if isinstance(layer, EmbeddingLayer):
                parallelize_embedding(layer.embed, self.tp_group, sp)
            elif isinstance(layer, Block):
                parallelize_block(layer, self.tp_group, sp)
            elif isinstance(layer, HeadLayer):
                head: Any = layer
                head.lm_head = parallelize_head(layer.lm_head, self.tp_group, sp)
        mark_tensor_parallel_group(self.stage, self.tp_group)

    def _checkpoint_blocks(self) -> None:
        group = self.tp_group if self.config.partition_activations else None
        for layer in self.stage:
            if isinstance(layer, Block):
                checkpoint_module(layer, partition_group=group)

    def _model_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the unsplit GPT."""
        out = {}
        for name, p in self.stage.named_parameters():
            index, _, rest = name.partition(".")
            layer = int(index) + self.pipeline.first_layer
            out[id(p)] = model_name(layer, rest, self.n_blocks)
        return out

    # -- steps ---------------------------------------------------------------------------------

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel replica's rows of the global batch."""
        dp, rank = self.mesh.size("dp"), self.mesh.rank("dp")
        if batch.shape[0] % dp:
            raise ValueError(f"parallelize: a batch of {batch.shape[0]} rows cannot be split "
                             f"over dp={dp} replicas")
        per = batch.shape[0] // dp
        return batch[rank * per : (rank + 1) * per]

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("tp") > 1:  # logits split over the vocabulary
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group).mean()
        return lm_loss(logits, targets)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One optimizer step on the global batch (the same ``tokens``/``targets`` on every
        rank); returns its mean loss and the gradient norm, on every rank."""
        loss = self.compute_gradients(tokens, targets)
        norm = clip_grad_norm_(self.phases.grad_parts(), self.config.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return StepResult(loss, norm, lr)

    def compute_gradients(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of every micro-batch, then :func:`finalize_grads`: the
        step's complete gradients, not yet clipped or applied. Returns the mean loss."""
        self.stage.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.pipeline.step(self._rows(tokens), self._rows(targets), self.loss_fn)
        finalize_grads(self.phases)
        return self._dp_mean(loss)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss of the global batch, without gradients."""
        self.stage.eval()
        loss = forward_loss(self.pipeline, self._rows(tokens), self._rows(targets), self.loss_fn)
        return self._dp_mean(loss)

    def _dp_mean(self, loss: torch.Tensor) -> float:
        value = loss.detach().double().reshape(1).clone()
        dist.all_reduce(value, group=self.mesh.group("dp"))
        return float(value) / self.mesh.size("dp")

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters as built (tensor-parallel parts, before any ZeRO-3
        sharding): what :attr:`names` and :attr:`shapes` know."""
        return self.params

    # -- checkpoints (parallel.compose.checkpoint: keyed by mesh position, any layout loads) ------

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        """Write parameters, optimizer and scheduler state and ``extra``; collective."""
        checkpoint.save(self, directory, extra)

    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written in any layout; returns its ``extra``; collective."""
        return checkpoint.load(self, directory)
