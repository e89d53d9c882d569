"""Scalings some HuggingFace families apply outside the modules their pp plan names, as
each family's own forward applies them (the plan does not guess: a family whose scaling
is not listed here is refused by name):

- Granite (``granite``, ``granitemoe``, ``granitemoeshared``): the embeddings times
  ``embedding_multiplier`` (in the base model's forward), the logits divided by
  ``logits_scaling``;
- Cohere (``cohere``, ``cohere2``, ``cohere2_moe``): the logits times ``logit_scale``;
- MiniCPM3: the last hidden states divided by ``logits_scaling`` before the head (no
  bias), which is the logits divided by it.

Each is a factor on a whole activation, elementwise, so it is the same on vocab-split
logits and on any pipeline or sequence split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

# model_type -> {config attribute: how it scales (embeddings "embed", logits "logits";
# "mul" or "div")}
FAMILY_SCALES: dict[str, dict[str, tuple[str, str]]] = {
    **{t: {"embedding_multiplier": ("embed", "mul"), "logits_scaling": ("logits", "div")}
       for t in ("granite", "granitemoe", "granitemoeshared")},
    **{t: {"logit_scale": ("logits", "mul")} for t in ("cohere", "cohere2", "cohere2_moe")},
    "minicpm3": {"logits_scaling": ("logits", "div")},
}


def applied_here(model: nn.Module) -> set[str]:
    """The config attributes whose scaling the plan applies for ``model``'s family."""
    config: Any = model.config
    return set(FAMILY_SCALES.get(getattr(config, "model_type", ""), {}))


def factor(model: nn.Module, where: str) -> float | None:
    """The factor on the embeddings (``where="embed"``) or the logits, or None."""
    out, config = 1.0, model.config
    for name, (at, how) in FAMILY_SCALES.get(getattr(config, "model_type", ""), {}).items():
        value = getattr(config, name, None)
        if at == where and value is not None:
            out = out * value if how == "mul" else out / value
    return None if out == 1.0 else out


@dataclass(frozen=True)
class ScaledSequence:
    """The modules one after another (a layer's default), the output times ``factor``."""

    factor: float

    def __call__(self, modules: Sequence[nn.Module], x: Any, _context: dict[str, Any]) -> Any:
        for module in modules:
            x = module(x)
        return x * self.factor


def scaled(call: Callable[..., Any], by: float | None) -> Callable[..., Any]:
    """``call``'s output times ``by`` (``call`` itself when None)."""
    if by is None:
        return call

    def scaled_call(modules: Sequence[nn.Module], x: Any, context: dict[str, Any]) -> Any:
        return call(modules, x, context) * by

    return scaled_call
