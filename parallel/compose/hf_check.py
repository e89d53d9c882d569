"""The check that a plan computes what a HuggingFace model computes: the plan layer by layer
and the model's own forward on a small fixed batch, plain, padded and packed, in eval and
training mode. :func:`pycomm.parallel.compose.parallelize` calls it for a model with real
weights, so a derivation that does not reproduce a family is refused, not trained wrong.

Example::

    plan = hf_causal_lm_plan(model)
    check_plan_forward(model, plan)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.hf import accepted_kwargs, logits_of
from ..plans.plan import ModelInputs, Plan
from .layers import sequential_forward


def _probe_tokens(model: nn.Module, device: torch.device) -> torch.Tensor:
    """A fixed (2, 8) batch of token ids spread over the vocabulary (no random draw)."""
    config: Any = model.config
    return (torch.arange(16, device=device) * 7919 % int(config.vocab_size)).reshape(2, 8)


def _probe_inputs(plan: Plan, device: torch.device) -> list[ModelInputs | None]:
    """The probe's model inputs: none; padding (row 0 left-padded by 2, row 1
    right-padded by 3); three packed documents (positions restarting) - those the plan
    takes."""
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[0, :2], mask[1, 5:] = 0, 0
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]], device=device)
    probes: list[ModelInputs | None] = [None]
    if "attention_mask" in plan.inputs:
        probes.append(ModelInputs(attention_mask=mask))
    if "position_ids" in plan.inputs:
        probes.append(ModelInputs(position_ids=packed))
    return probes


def _difference(model: nn.Module, plan: Plan, tokens: torch.Tensor,
                inputs: ModelInputs | None, seed: int) -> float:
    given = inputs.given() if inputs is not None else {}
    # No cache, as in training: with one, transformers does not read packed documents
    # from the position ids (and the plan's context never has one).
    given = {**given, **accepted_kwargs(model.forward, {"use_cache": False})}
    torch.manual_seed(seed)  # the same draws for both, where dropout is on
    want = logits_of(model(tokens, **given))
    torch.manual_seed(seed)
    got = sequential_forward(model, plan, tokens, inputs)
    return float((got.float() - want.float()).abs().max())


def check_plan_forward(model: nn.Module, plan: Plan, atol: float = 1e-5) -> float:
    """Run ``plan`` layer by layer and the model's own forward on a small fixed batch
    (2 x 8 tokens; also padded and packed where the plan takes an attention mask and
    position ids): in eval mode, then in training mode with the same random draws (a
    plan that drops a dropout, or moves one, then differs). No gradients; every module's
    mode and the random generators are as before.

    A model input the family's own forward treats otherwise than the plan (GPT-OSS's masks
    do not read the position ids, so its attention crosses packed documents), or cannot
    take (a padding mask that Youtu's attention fails on), is taken out of
    ``plan.inputs``: a batch giving it is then refused by name, not trained otherwise
    than the model computes.

    Returns:
        The largest difference of the logits.

    Raises:
        ValueError: naming the model class, the mode, the inputs and the difference, when
            it exceeds ``atol``.
    """
    device = next(model.parameters()).device
    tokens = _probe_tokens(model, device)
    modes = [(m, m.training) for m in model.modules()]
    devices = [device.index or 0] if device.type == "cuda" else []
    worst = 0.0
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for training in (False, True):
                model.train(training)
                for inputs in _probe_inputs(plan, device):
                    if inputs is not None:
                        _narrow_inputs(model, plan, tokens, inputs, atol)
                        continue
                    diff = _difference(model, plan, tokens, inputs, seed=1234)
                    if not diff <= atol:  # also NaN
                        given = sorted(inputs.given()) if inputs is not None else "no"
                        raise ValueError(
                            f"plan for {type(model).__name__} does not reproduce its forward "
                            f"({'training' if training else 'eval'} mode, {given} model "
                            f"inputs): logits differ by up to {diff:.3g} (atol {atol:g}); "
                            "pass plan= with one that does")
                    worst = max(worst, diff)
    finally:
        for module, mode in modes:
            module.training = mode
    return worst


def _narrow_inputs(model: nn.Module, plan: Plan, tokens: torch.Tensor, inputs: ModelInputs,
                   atol: float) -> None:
    """Takes the probe's inputs out of ``plan.inputs`` unless the plan reproduces the
    model's forward on them (see :func:`check_plan_forward`)."""
    try:
        same = _difference(model, plan, tokens, inputs, seed=1234) <= atol
    except (RuntimeError, ValueError, TypeError):  # the family's forward cannot take them
        same = False
    if not same:
        plan.inputs = tuple(k for k in plan.inputs if k not in inputs.given())
