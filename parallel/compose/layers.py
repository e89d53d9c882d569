"""A plan's layers as modules a pipeline can cut: :class:`PlannedLayer`, and which
layers each stage keeps.

A :class:`PlannedLayer` runs one layer of the plan (its modules, by its ``call``) on the
previous layer's output. Blocks also get the plan's context (a rotary table, masks),
computed on each stage from the batch's shape, and, with sequence parallelism, run on
this rank's part of the sequence: the first block splits its input along the sequence,
the last gathers its output, and everything between (norms, residuals, dropout) works on
``1/TP`` of the tokens, its random draws on the per-rank stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..plans.plan import ContextRequest, ModelInputs, Plan, ResolvedLayer, resolve_layers
from ..tensor.sequence import SequenceSplit, on_sequence_part


class ContextCache:
    """The plan's context for the micro-batch being computed: its :class:`ModelInputs`
    are set before each forward (and before each backward, which may recompute), and the
    values are computed once per request (a rotary table, the masks) while they stand."""

    def __init__(self, plan: Plan):
        self.fn = plan.context
        self.inputs: ModelInputs | None = None
        self._values: dict[tuple[Any, ...], dict[str, Any]] = {}

    def set_inputs(self, inputs: ModelInputs | None) -> None:
        """The micro-batch's model inputs (None: every token real, one document a row)."""
        if inputs is not self.inputs:
            self.inputs, self._values = inputs, {}

    def get(self, request: ContextRequest) -> dict[str, Any]:
        key = (request.batch, request.seq, request.dtype, request.device)
        if key not in self._values:
            values: dict[str, Any] = {}
            if self.fn is not None:
                with torch.no_grad():
                    values = dict(self.fn(request))
            self._values[key] = {**values, "inputs": request.inputs}
        return self._values[key]


def _chain(modules: Sequence[nn.Module], x: Any, _context: dict[str, Any]) -> Any:
    for module in modules:
        x = module(x)
    return x


class PlannedLayer(nn.Module):
    """One layer of a plan (see the module docstring)."""

    def __init__(self, layer: ResolvedLayer, modules: list[nn.Module],
                 context: ContextCache | None, split: SequenceSplit | None):
        super().__init__()
        self.layer = layer
        self.mods = nn.ModuleList(modules)
        self.call = layer.call or _chain
        # blocks (the plan's context) and layers whose own call may read the batch's
        # inputs (position ids)
        self.context = context if layer.is_block or layer.call is not None else None
        self.split = split

    def _request(self, x: torch.Tensor, split_input: bool) -> ContextRequest:
        assert self.context is not None
        seq = x.shape[1] * (self.split.world if split_input and self.split else 1)
        inputs = self.context.inputs
        if inputs is not None:
            _check_inputs_fit(inputs, x.shape[0], seq, self.layer.name)
        return ContextRequest(x.shape[0], seq, x.dtype, x.device, inputs)

    def forward(self, x: Any) -> Any:
        split = self.split
        inside = split is not None and split.inside
        context: dict[str, Any] = {}
        if self.context is not None and self.layer.is_block and torch.is_tensor(x) \
                and x.dim() >= 2:
            context = self.context.get(self._request(x, inside and not split.scatter))  # type: ignore[union-attr]
        elif self.context is not None:  # a layer's own call: the batch's inputs only
            context = {"inputs": self.context.inputs}
        return on_sequence_part(split, lambda y: self.call(list(self.mods), y, context), x)

    def extra_repr(self) -> str:
        return f"layer {self.layer.index}: {self.layer.name}"


def _check_inputs_fit(inputs: ModelInputs, batch: int, seq: int, layer: str) -> None:
    for name, value in inputs.given().items():
        if tuple(value.shape) != (batch, seq):
            raise ValueError(f"layer {layer}: {name} of shape {tuple(value.shape)} does not fit "
                             f"its input's (batch, sequence) ({batch}, {seq})")


def stage_balance(layers: list[ResolvedLayer], stages: int, plan_name: str) -> list[int]:
    """Layers per pipeline stage: the blocks as evenly as possible (earlier stages take
    the extra ones); the layers before the first block on the first stage, those after a
    block with it. Without blocks, every layer counts as one.

    Raises:
        ValueError: fewer blocks (or layers) than stages.
    """
    weights = [1 if (layer.is_block or not any(x.is_block for x in layers)) else 0
               for layer in layers]
    units = sum(weights)
    if units < stages:
        kind = "blocks" if any(x.is_block for x in layers) else "layers"
        raise ValueError(f"pipeline: the plan of {plan_name} has {units} {kind}, which cannot "
                         f"be split over pp = {stages} stages (each needs at least one)")
    base, extra = divmod(units, stages)
    quota = [base + (1 if s < extra else 0) for s in range(stages)]
    balance, stage, taken = [0] * stages, 0, 0
    for weight in weights:
        if weight and taken == quota[stage]:
            stage, taken = stage + 1, 0
        balance[stage] += 1
        taken += weight
    return balance


def planned_layers(model: nn.Module, plan: Plan, layers: list[ResolvedLayer],
                   split_for: Any = None, cache: ContextCache | None = None
                   ) -> list[PlannedLayer]:
    """A :class:`PlannedLayer` for each of ``layers`` (``split_for(layer)``: its
    :class:`SequenceSplit`, or None), sharing one context cache (``cache``, or a new one)."""
    cache = cache if cache is not None else ContextCache(plan)
    return [PlannedLayer(layer, [model.get_submodule(p) for p in layer.paths], cache,
                         split_for(layer) if split_for else None) for layer in layers]


def sequential_forward(model: nn.Module, plan: Plan, tokens: torch.Tensor,
                       inputs: ModelInputs | None = None) -> torch.Tensor:
    """The model's logits computed layer by layer as the plan says, in one process: what
    every pipeline split of it computes (a plan whose layers do not reproduce the
    model's own forward is wrong; compare with
    ``plan.output(model(tokens, **inputs.given()))``)."""
    cache = ContextCache(plan)
    cache.set_inputs(inputs)
    x: Any = tokens
    for layer in planned_layers(model, plan, resolve_layers(plan, model), cache=cache):
        x = layer(x)
    return plan.output(x) if plan.output is not None else x
