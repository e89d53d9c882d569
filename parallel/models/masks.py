"""The attention masks of batches with padding and packed documents, as HuggingFace builds
them: a query attends to earlier keys that are real tokens of its own document."""

from __future__ import annotations

import torch
from torch import nn


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed document each token belongs to (0, 1, ... along a row): a new one
    starts wherever the position does not follow the previous one (HuggingFace's
    ``find_packed_sequence_indices``)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def attention_mask_of(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                      seq: int, device: torch.device) -> torch.Tensor | None:
    """The (batch, 1, seq, seq) boolean mask of what each query may attend to: earlier
    keys that are real tokens (``attention_mask``) of its own document (``position_ids``);
    None where that is plain causal attention. A padding token attends to itself, so no
    row is empty (its output is never trained on, and every kernel stays finite)."""
    if attention_mask is None and position_ids is None:
        return None
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    if position_ids is not None:
        docs = document_ids(position_ids)
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return mask | torch.eye(seq, dtype=torch.bool, device=device)


def with_mask(module: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``module(x)``, given ``mask=`` only where there is one: a module whose inputs are
    described one per positional argument (DTensor's ``PrepareModuleInput``) or whose
    forward was replaced (the fused kernels) sees the call it always saw."""
    return module(x) if mask is None else module(x, mask=mask)
