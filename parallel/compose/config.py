"""What to parallelize and how: :class:`ParallelConfig` (the mesh's sizes come from the
mesh, the model's parts from its plan), and the result of one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..mesh import ParallelMesh
from ..moe.capacity import POLICIES

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("none", "cpu", "disk")
_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAME = {v: k for k, v in _COMPUTE.items()}


@dataclass
class ParallelConfig:
    """How to parallelize.

    Args:
        sequence_parallel: split activations along the sequence inside the blocks.
        zero: 0 for data parallelism, 1-3 for that ZeRO stage over ``dp``.
        recompute: checkpoint each recompute unit of the plan (default: every block).
        partition_activations: ``P_a``: each TP rank keeps 1/TP of a checkpointed block's
            input (needs ``recompute``; not with sequence parallelism).
        microbatches: micro-batches per step (the pipeline's M; 1 without a pipeline).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        optimizer: the ``torch.optim`` class, and ``optimizer_kwargs`` its arguments.
        weight_decay: applied to matrices only (biases, norms: none), as GPT recipes do.
        lr_lambda: multiplies the learning rate at each step (a warmup/decay schedule).
        bucket_mb: gradient bucket size (C_B).
        seed: seeds the random streams (dropout), and the weights of a model built on
            the meta device.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype forward and backward
            compute in; the optimizer steps fp32 master weights (in ZeRO's shards) with
            fp32 state. None: the model's own dtype.
        reduce_dtype: the dtype gradients are reduced in (default fp32).
        loss_fn: ``fn(logits, targets)`` returning a ``(sum, count)`` pair (the loss is
            the sum over every micro-batch and replica divided by the global count, as
            one process computes it) or a micro-batch's mean loss (weighted by its rows);
            default: the cross-entropy over the targets that are not ``ignore_index``,
            divided by their global count (vocab-parallel where the head is split over
            the vocabulary). See :mod:`pycomm.parallel.compose.loss`.
        ignore_index: targets the default loss skips (HuggingFace's -100: padding,
            prompt tokens in SFT).
        compile: ``torch.compile`` each block of the plan in place (the modules a block
            layer runs: torchtitan's per-block compilation), after the other strategies
            are applied; the layers' communication stays outside the compiled code.
        sync_batchnorm: BatchNorm layers normalise over the whole data-parallel batch
            (:mod:`pycomm.parallel.data.sync_batchnorm`), so a layout trains what one process
            trains; where no layer can see the whole batch (micro-batches, sequence
            parallelism, recompute) the model is refused. False: each replica and
            micro-batch normalises its own rows (DDP without SyncBatchNorm, GPipe).
        loss_scale: fp16's dynamic loss scaling: the initial scale, halved on an
            overflow (the step is skipped) and doubled after ``loss_scale_window``
            steps without one.
        offload: ZeRO-3's units (shards, fp32 masters, Adam state) kept in files under
            ``offload_dir`` (``"disk"``) or in host memory (``"cpu"``), read
            ``offload_prefetch`` units ahead and stepped unit by unit in backward
            (:mod:`pycomm.parallel.zero.offload`; with clipping, ``max_grad_norm``, stepped after
            backward once the norm is known; micro-batches summed in the records first;
            bf16 or fp16 compute gathers casts of the fp32 masters). Runs with tp and
            pp (each rank offloads the units it holds; the norm counts a parameter
            replicated over tp once; a tie across pipeline stages defers the steps
            until its copies' gradients are summed), and needs an optimizer whose
            state is per element (its state tensors are the records' fields). At
            zero 1-2 it is ZeRO-Offload: only the optimizer state lives in the store,
            stepped bucket by bucket after the reduction, the masters in memory (any
            tp and pp). Every layer outside the blocks holding
            ``OWN_UNIT_NUMEL`` parameters or more (an embedding, an untied head) is then a
            unit of its own, gathered only around its use.
        max_live_units, max_live_bytes: ZeRO-3's budget (DeepSpeed's
            ``stage3_max_live_parameters``): a unit is gathered ahead of use only while
            the units gathered and the whole-unit buffers (gathered parameters, gradients
            being reduced) stay within them; buffers beyond ``max_live_bytes`` are freed
            between uses (:class:`pycomm.parallel.zero.sharded_model.LiveBudget`).
        max_unit_bytes: ZeRO-3's largest unit (of the masters): a layer outside the
            blocks holding more is split into tiles of at most this much, each a unit
            gathered alone (DeepSpeed's ``TiledLinear``; :mod:`pycomm.parallel.compose.tiles`):
            an embedding by rows, the head by vocabulary chunks, the default
            cross-entropy then taken in those chunks (:mod:`pycomm.parallel.compose.chunked_loss`;
            a ``loss_fn`` is given the whole logits). A larger layer
            it cannot split (not a plain ``nn.Embedding`` or ``nn.Linear``, a tied one,
            tp > 1) is refused by name. None: layers stay whole.
        capacity_factor: a mixture of experts' expert capacity (Megatron-LM's
            ``moe_expert_capacity_factor``): each experts call gives every expert room
            for ``ceil(tokens * k / E * factor)`` assignments and drops the rest
            (:mod:`pycomm.parallel.moe.capacity`; ``StepResult.dropped`` counts them). None:
            dropless.
        drop_policy: which assignments a full expert keeps: ``"probs"`` (the highest
            routing weights) or ``"position"`` (the first tokens).
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
    precision: str | None = None
    reduce_dtype: torch.dtype = torch.float32
    loss_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
    ignore_index: int = -100
    sync_batchnorm: bool = True
    compile: bool = False
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    offload: str = "none"
    offload_dir: str = ""
    offload_prefetch: int = 2
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    max_live_units: int | None = None
    max_live_bytes: int | None = None
    max_unit_bytes: int | None = None

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
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"parallelize: precision must be one of {PRECISIONS} or None, got "
                             f"{self.precision!r}")
        if not self.reduce_dtype.is_floating_point:
            raise ValueError(f"parallelize: reduce_dtype must be a floating dtype, got "
                             f"{self.reduce_dtype}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"parallelize: capacity_factor must be > 0 (or None: dropless), "
                             f"got {self.capacity_factor!r}")
        if self.drop_policy not in POLICIES:
            raise ValueError(f"parallelize: drop_policy must be one of {POLICIES}, got "
                             f"{self.drop_policy!r}")
        self._check_live_budget()
        if self.max_unit_bytes is not None and mesh.size("tp") > 1:
            raise ValueError(f"parallelize: max_unit_bytes with tp={mesh.size('tp')}: the "
                             "embedding and head are split over the vocabulary by tensor "
                             "parallelism, tiles split whole layers (use one of them)")
        self._check_offload(mesh)

    def _check_live_budget(self) -> None:
        for name in ("max_live_units", "max_live_bytes", "max_unit_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 1:
                raise ValueError(f"parallelize: {name} must be >= 1 (or None), got {value}")
            if self.zero != 3:
                raise ValueError(f"parallelize: {name} bounds ZeRO-3's gathered units; it "
                                 f"does nothing at zero={self.zero} (use zero=3)")

    def _check_offload(self, mesh: ParallelMesh) -> None:
        """Offload steps each unit in backward, from its record: what needs a whole
        gradient first, or another sharding, cannot run with it."""
        if self.offload not in OFFLOADS:
            raise ValueError(f"parallelize: offload must be one of {OFFLOADS}, got "
                             f"{self.offload!r}")
        if self.offload == "none":
            return
        unsteppable = self._per_element_state()
        refused = [
            (self.zero == 0, "zero=0 (offload moves ZeRO's optimizer state: zero 1-2, or "
             "ZeRO-3's units: zero=3)"),
            (mesh.size("ep") > 1, f"ep={mesh.size('ep')} (the experts beside ZeRO-3 stay "
             "whole in memory, stepped after backward; offload steps units in backward)"),
            (unsteppable is not None, f"optimizer={self.optimizer.__name__} ({unsteppable})"),
            (self.offload == "disk" and not self.offload_dir, "offload_dir='' (disk "
             "needs a directory)"),
            (self.offload_prefetch < 0, f"offload_prefetch={self.offload_prefetch} (>= 0)"),
        ]
        named = [what for bad, what in refused if bad]
        if named:
            raise ValueError(f"parallelize: offload={self.offload!r} cannot run with "
                             + "; ".join(named))

    def _per_element_state(self) -> str | None:
        """Why the optimizer cannot step unit by unit from records, or None."""
        from ..zero.offload_step import optimizer_state_layout

        try:
            optimizer_state_layout(self.optimizer, self.optimizer_kwargs)
        except ValueError as err:
            return str(err)
        return None

    def compute_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype forward and backward run in (the model's own when unset)."""
        return _COMPUTE[self.precision] if self.precision else model_dtype

    def precision_name(self, model_dtype: torch.dtype) -> str:
        dtype = self.compute_dtype(model_dtype)
        if dtype not in _NAME:
            raise ValueError(f"parallelize: a {dtype} model needs precision= one of "
                             f"{PRECISIONS}")
        return _NAME[dtype]


@dataclass
class StepResult:
    loss: float  # the loss of the global batch, as one process computes it
    grad_norm: float  # before clipping (inf or nan on an fp16 overflow)
    lr: float
    skipped: bool = False  # fp16: the gradients overflowed, the update was not applied
    loss_scale: float = 1.0
    tokens: int = 0  # the targets the loss counted (not ignored) in the global batch
    aux_loss: float = 0.0  # the routers' load-balancing loss (times its coefficient) in loss
    dropped: int = 0  # (token, expert) assignments over capacity, dropped (capacity_factor)
