"""GPipe pipeline parallelism: one stage per rank, micro-batches, re-materialization.

Each rank keeps its ``balance[rank]`` consecutive layers of an ``nn.Sequential`` and
walks its list from a schedule (:mod:`pycomm.parallel.pipeline.schedule`): ``F m`` receives
micro-batch ``m``'s activation from the previous stage (the first stage splits the
inputs instead), runs the stage and sends the output on; ``B m`` receives the gradient
of that output from the next stage (the last stage starts from the loss), runs the
stage's backward and sends its input's gradient back. Sends are asynchronous, so a stage
computes the next step while its last output travels.

Re-materialization (``checkpoint``) runs a stage's forward without keeping its
activations and recomputes them in backward with every generator replayed, torch's and
every stream of :data:`pycomm.parallel.rng.TRACKER` (tensor-parallel dropout draws the same
masks, and the next micro-batch's forward continues the streams as without it):
``"always"``, ``"except_last"`` (not the last micro-batch, whose
backward follows its forward at once under GPipe) or ``"never"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as rematerialize

from ..rng import TRACKER
from .microbatch import batch_size, shape_signature, split_batch
from .p2p import PendingSend, Receiver, send_tensor
from .schedule import SCHEDULES, Step

CHECKPOINT_MODES = ("always", "except_last", "never")


@dataclass
class _Micro:
    """One micro-batch's state on this stage between its forward and its backward."""

    inputs: torch.Tensor | None = None  # received activation (None on the first stage)
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None  # the last stage: weighted loss


@dataclass
class Event:
    """One step of the last :meth:`Pipeline.step`, in ``time.perf_counter`` seconds
    (system-wide on Linux, so stages' events line up)."""

    stage: int
    kind: str
    micro: int
    start: float
    end: float


@dataclass
class _StepState:
    micro: dict[int, _Micro] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # the last stage's weighted losses
    order: dict[str, list[Any]] = field(default_factory=dict)  # message keys per direction
    received: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})


class Pipeline:
    """This rank's stage of ``module`` and the machinery to train it with the others.

    Args:
        module: the whole model as an ``nn.Sequential`` (the same on every rank).
        balance: layers per stage, one entry per rank of the group.
        chunks: micro-batches per mini-batch (M).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        process_group: the pipeline's ranks, stage ``i`` on group rank ``i``.

    Raises:
        ValueError: balance not summing to the layers or not one entry per rank, an
            unknown schedule or checkpoint mode, chunks < 1.
    """

    def __init__(self, module: nn.Sequential, balance: list[int], chunks: int,
                 checkpoint: str = "except_last", schedule: str = "gpipe",
                 process_group: dist.ProcessGroup | None = None):
        self.group = process_group
        self.num_stages, self.stage_id = dist.get_world_size(process_group), dist.get_rank(
            process_group)
        _validate(module, balance, chunks, checkpoint, schedule, self.num_stages)
        self.chunks, self.checkpoint, self.schedule = chunks, checkpoint, schedule
        # fp16's loss scaling: backward starts from loss * loss_scale (the loss reported
        # stays unscaled); the gradients sent between stages are then scaled too
        self.loss_scale = 1.0
        # Called with a micro-batch's index before its forward and before its backward
        # (which may recompute the forward): a layer reading that micro-batch's other
        # inputs (its attention mask) finds them set.
        self.before_micro: Callable[[int], None] | None = None
        # Called once per step, before its first backward (every forward of this stage
        # has run): statistics over the whole batch (the routers' load balance).
        self.before_backward: Callable[[], None] | None = None
        self.first_layer = sum(balance[: self.stage_id])
        layers = list(module)[self.first_layer : self.first_layer + balance[self.stage_id]]
        self.stage = nn.Sequential(*layers)
        self._events: list[Event] = []
        # activations from the previous stage, gradients from the next
        self._from_prev = Receiver(self.stage_id - 1, process_group) if self.stage_id else None
        self._from_next = (Receiver(self.stage_id + 1, process_group)
                           if self.stage_id < self.num_stages - 1 else None)

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def parameters(self) -> Any:
        """This stage's parameters (for its optimizer)."""
        return self.stage.parameters()

    def named_parameters(self) -> Any:
        """This stage's parameters named as in the whole ``nn.Sequential``."""
        for name, p in self.stage.named_parameters():
            index, _, rest = name.partition(".")
            yield f"{int(index) + self.first_layer}.{rest}", p

    # -- one training step -----------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any, loss_fn: Any, loss_is_mean: bool = True
             ) -> torch.Tensor:
        """Forward and backward of one mini-batch; gradients accumulate in the stage's
        parameters. Every rank calls it; only the first stage's ``inputs`` and the last
        stage's ``targets`` are used (pass None elsewhere). ``loss_fn(output, target)``
        returns the mean over its micro-batch, and the micro-batch losses are weighted
        by their rows, so the result is the mini-batch's mean loss, returned on every
        rank; with ``loss_is_mean=False`` it returns the micro-batch's share of the
        mini-batch's loss (its sum over the batch's count of tokens: what a batch whose
        rows hold different numbers of tokens needs), and the shares are summed.

        Raises:
            ValueError: on every rank, if the first stage's batch has fewer rows than
                ``chunks`` or the last stage's targets do not have the same rows.
        """
        rows, signature = self._agree_on_rows(inputs, targets)
        state = _StepState()
        ins = split_batch(inputs, self.chunks) if self.is_first else None
        tgts = split_batch(targets, self.chunks) if self.is_last else None
        weights = ([t.shape[0] / rows for t in split_batch(torch.empty(rows), self.chunks)]
                   if loss_is_mean else [1.0] * self.chunks)
        self._events = []
        steps = SCHEDULES[self.schedule](self.chunks, self.num_stages)[self.stage_id]
        state.order = {kind: [(signature, s.micro) for s in steps if s.kind == kind]
                       for kind in "FB"}
        self._prepost("F", state, 0)
        self._prepost("B", state, 0)
        last_backward = max(i for i, s in enumerate(steps) if s.kind == "B")
        first_backward = min(i for i, s in enumerate(steps) if s.kind == "B")
        for i, step in enumerate(steps):
            if step.kind == "F":
                self._forward(step, state, ins, tgts, loss_fn, weights)
            else:
                if i == first_backward and self.before_backward is not None:
                    self.before_backward()
                self._sync_data_parallel(last=i == last_backward)
                self._backward(step, state)
        for pending in state.sends:
            pending.wait()
        return self._total_loss(state)

    def _forward(self, step: Step, state: _StepState, ins: list[Any] | None,
                 tgts: list[Any] | None, loss_fn: Any, weights: list[float]) -> None:
        m, micro = step.micro, _Micro()
        self.entering(m)
        if ins is not None:  # the first layer gets the micro-batch as it is (tuple, dict...)
            stage_input = ins[m]
        else:
            received = self._receive("F", state)
            micro.inputs = received.requires_grad_(received.is_floating_point())
            stage_input = micro.inputs
        start = time.perf_counter()
        if self._rematerialize(m):
            # torch restores only its own generators; the tracker replays those and its
            # streams (TP dropout), so it does all of it
            out = rematerialize(self.stage, stage_input, use_reentrant=False,
                                preserve_rng_state=False,
                                context_fn=TRACKER.checkpoint_context)
        else:
            out = self.stage(stage_input)
        if tgts is not None:
            micro.loss = loss_fn(out, tgts[m]) * weights[m]
            state.losses.append(float(micro.loss.detach()))
        else:
            if not torch.is_tensor(out):
                raise TypeError(f"pipeline: stage {self.stage_id} returns a {type(out).__name__}; "
                                "a pipeline passes one tensor from stage to stage (a plan's "
                                "layer call must return the activations)")
            micro.output = out
            state.sends.append(send_tensor(out, self.stage_id + 1, self.group))
        self._events.append(Event(self.stage_id, "F", m, start, time.perf_counter()))
        state.micro[m] = micro

    def _backward(self, step: Step, state: _StepState) -> None:
        micro = state.micro.pop(step.micro)
        self.entering(step.micro)
        if micro.loss is not None:
            start = time.perf_counter()
            scaled = micro.loss * self.loss_scale if self.loss_scale != 1.0 else micro.loss
            scaled.backward()
        else:
            grad = self._receive("B", state)
            start = time.perf_counter()
            assert micro.output is not None
            torch.autograd.backward(micro.output, grad)
        if micro.inputs is not None:
            grad_in = micro.inputs.grad
            if grad_in is None:
                grad_in = torch.zeros_like(micro.inputs)
            state.sends.append(send_tensor(grad_in, self.stage_id - 1, self.group))
        self._events.append(Event(self.stage_id, "B", step.micro, start, time.perf_counter()))

    def entering(self, micro: int) -> None:
        """Micro-batch ``micro``'s forward or backward is next (see ``before_micro``)."""
        if self.before_micro is not None:
            self.before_micro(micro)

    def _sync_data_parallel(self, last: bool) -> None:
        """A stage wrapped in a data-parallel module (``pycomm.parallel.data.DataParallel``)
        averages its gradients in the step's last backward only; the others accumulate."""
        prepare = getattr(self.stage, "prepare_for_backward", None)
        if prepare is not None:
            prepare(sync=last)

    def _receive(self, kind: str, state: _StepState) -> torch.Tensor:
        """The next activation ("F") or gradient ("B"), and the one after posted."""
        receiver = self._from_prev if kind == "F" else self._from_next
        assert receiver is not None
        i = state.received[kind]
        state.received[kind] += 1
        out = receiver.take(state.order[kind][i])
        self._prepost(kind, state, i + 1)
        return out

    def _prepost(self, kind: str, state: _StepState, i: int) -> None:
        receiver = self._from_prev if kind == "F" else self._from_next
        if receiver is not None and i < len(state.order[kind]):
            receiver.prepost(state.order[kind][i])

    def _rematerialize(self, m: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last"
                                               and m != self.chunks - 1)

    # -- agreement and results -------------------------------------------------------------------

    def _agree_on_rows(self, inputs: Any, targets: Any) -> tuple[int, int]:
        """The first stage's rows, checked against ``chunks`` and the targets' rows on
        every rank at once (so a bad batch raises everywhere instead of hanging), and a
        signature of the inputs' shapes (messages of equal signatures have equal shapes,
        so their receives can be posted ahead)."""
        info = torch.zeros(3, dtype=torch.int64)  # rows (first stage), target rows, signature
        if self.is_first:
            info[0] = batch_size(inputs) or 0
            info[2] = shape_signature(inputs)
        if self.is_last:
            info[1] = batch_size(targets) or 0
        dist.all_reduce(info, group=self.group)
        rows, target_rows = int(info[0]), int(info[1])
        if rows < self.chunks:
            raise ValueError(f"Pipeline.step: the batch has {rows} rows, fewer than chunks="
                             f"{self.chunks}")
        if target_rows != rows:
            raise ValueError(f"Pipeline.step: the first stage's inputs have {rows} rows but "
                             f"the last stage's targets {target_rows}")
        return rows, int(info[2])

    def _total_loss(self, state: _StepState) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64)
        if self.is_last:
            total[0] = sum(state.losses)
        src = self.num_stages - 1
        dist.broadcast(total, src=dist.get_global_rank(self.group, src)
                       if self.group is not None else src, group=self.group)
        return total[0]

    def receive_stats(self) -> dict[str, int]:
        """Messages received so far whose receive was posted ahead, and the others."""
        receivers = [r for r in (self._from_prev, self._from_next) if r is not None]
        return {"posted_ahead": sum(r.posted_ahead for r in receivers),
                "received_now": sum(r.received_now for r in receivers)}

    def trace(self) -> list[Event]:
        """This stage's events in the last step."""
        return list(self._events)

    def gather_trace(self) -> list[Event]:
        """Every stage's events in the last step, on every rank (collective)."""
        everyone: list[Any] = [None] * self.num_stages
        dist.all_gather_object(everyone, self._events, group=self.group)
        return [event for events in everyone for event in events]


def _validate(module: nn.Sequential, balance: list[int], chunks: int, checkpoint: str,
              schedule: str, num_stages: int) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"Pipeline: module must be an nn.Sequential, got {type(module).__name__}")
    if len(balance) != num_stages or any(b < 1 for b in balance):
        raise ValueError(f"Pipeline: balance {balance} must have one positive entry per rank "
                         f"({num_stages} ranks)")
    if sum(balance) != len(module):
        raise ValueError(f"Pipeline: balance {balance} covers {sum(balance)} layers, the "
                         f"module has {len(module)}")
    if chunks < 1:
        raise ValueError(f"Pipeline: chunks must be >= 1, got {chunks}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"Pipeline: checkpoint must be one of {CHECKPOINT_MODES}, got "
                         f"{checkpoint!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"Pipeline: schedule must be one of {sorted(SCHEDULES)}, got "
                         f"{schedule!r}")
