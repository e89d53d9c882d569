"""The global batch a step receives, checked on every rank before anything runs: its
targets, and the model inputs beside its tokens (which the plan must take)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..plans.plan import MODEL_INPUTS, ModelInputs, Plan, matching


def vocab_of(model: nn.Module, plan: Plan) -> int | None:
    """The width of the plan's vocab-parallel head (the logits the default loss reads),
    or None where the plan has none."""
    for pattern, style in plan.tp.items():
        if style != "vocab_head":
            continue
        for path in matching(pattern, model):
            width = getattr(model.get_submodule(path), "out_features", None)
            if isinstance(width, int):
                return width
    return None


def check_targets(targets: torch.Tensor, config: Any, vocab: int | None) -> None:
    """Targets the default cross-entropy can take: integers in ``[0, vocab)`` or the
    ``ignore_index``. Checked on the global batch that every rank holds, so a bad one is
    refused on every rank at once (a last pipeline stage raising alone would leave the
    others waiting for its gradients).

    Raises:
        ValueError: naming the first bad target, its position and the range.
    """
    if config.loss_fn is not None:
        return
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"parallelize: targets of dtype {targets.dtype}; the default "
                         "cross-entropy takes class indices (integers), or give loss_fn")
    ignore = config.ignore_index
    bad = (targets != ignore) & (targets < 0)
    if vocab is not None:
        bad |= (targets != ignore) & (targets >= vocab)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        span = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise ValueError(f"parallelize: target {int(targets[where])} at {where} is outside "
                         f"{span} and is not the ignore_index {ignore}")


def model_inputs(tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, plan: Plan) -> ModelInputs | None:
    """The batch's model inputs, checked: each the tokens' ``(batch, seq)`` shape, of
    integers (or bool, for the mask), and taken by the plan.

    Raises:
        ValueError: naming the input, its shape or dtype, or the plan that does not take
            it (a mask the model would never see would train it on the padding).
    """
    inputs = ModelInputs(attention_mask, position_ids)
    given = inputs.given()
    if not given:
        return None
    for name, value in given.items():
        if not torch.is_tensor(value) or tuple(value.shape) != tuple(tokens.shape[:2]):
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"parallelize: {name} of shape {shape}; it must have the "
                             f"tokens' (batch, seq) shape {tuple(tokens.shape[:2])}")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"parallelize: {name} of dtype {value.dtype}; it takes integers")
        if name not in plan.inputs:
            taken = ", ".join(plan.inputs) or "none"
            raise ValueError(f"parallelize: the plan for {plan.name} does not take {name} "
                             f"(it takes: {taken}); its layers would never see it. A plan "
                             f"names what it honours in Plan(inputs=...) from {MODEL_INPUTS}")
    return inputs
