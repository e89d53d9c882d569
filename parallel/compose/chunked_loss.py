"""Cross-entropy over logits taken in chunks of the vocabulary (a tiled head's chunks).

``F.cross_entropy`` on bf16 logits widened to float32 holds, at its peak, the float32
copy, its float32 log-softmax (saved for backward) and the float32 gradient: three
float32 copies of the whole logits, the largest activation of a large-vocabulary model.
Here the log-sum-exp is accumulated chunk by chunk in float32 (the one float32 chunk
alive at a time), backward recomputes each chunk's softmax from the logits themselves
(saved in their own dtype) and writes the gradient in that dtype. The result equals
``F.cross_entropy(logits.float(), targets, reduction="sum")`` up to the order of the
float32 sums.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch


def _checked(flat: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    keep = targets != ignore_index
    bad = keep & ((targets < 0) | (targets >= flat.shape[1]))
    if bool(bad.any()):
        raise ValueError(f"cross-entropy: target {int(targets[bad][0])} is outside the "
                         f"vocabulary [0, {flat.shape[1]}) and is not ignore_index "
                         f"({ignore_index})")
    return keep


def _wide(logits: torch.Tensor) -> torch.dtype:
    """float32, or the logits' dtype where it is wider (a float64 reference)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        keep = _checked(flat, flat_targets, ignore_index)
        wide = _wide(logits)
        lse = torch.full((flat.shape[0],), float("-inf"), dtype=wide, device=flat.device)
        for start, stop in bounds:
            lse = torch.logaddexp(lse, torch.logsumexp(flat[:, start:stop].to(wide), dim=-1))
        picked = flat.gather(1, flat_targets.clamp(0, flat.shape[1] - 1).unsqueeze(1))
        losses = torch.where(keep, lse - picked.squeeze(1).to(wide), 0.0)
        ctx.save_for_backward(logits, flat_targets, keep, lse)
        ctx.bounds = bounds
        return losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        logits, targets, keep, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty_like(flat)
        weight = (grad.to(lse.dtype) * keep).unsqueeze(1)
        for start, stop in ctx.bounds:
            probs = torch.exp(flat[:, start:stop].to(lse.dtype) - lse.unsqueeze(1))
            here = keep & (targets >= start) & (targets < stop)
            rows = here.nonzero().squeeze(1)
            probs[rows, targets[rows] - start] -= 1.0
            out[:, start:stop] = probs * weight
        return out.view_as(logits), None, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                          bounds: list[tuple[int, int]]) -> torch.Tensor:
    """The sum of the per-token cross-entropies of the targets that are not
    ``ignore_index``, in float32 (or the logits' wider dtype), the vocabulary taken in
    ``bounds`` (``[start, stop)`` chunks covering it).

    Raises:
        ValueError: a target outside the vocabulary that is not ignored.
    """
    if bounds[0][0] != 0 or bounds[-1][1] != logits.shape[-1] or any(
            a[1] != b[0] for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cross-entropy: chunks {bounds} do not cover the vocabulary of "
                         f"{logits.shape[-1]} in order")
    return _ChunkedCrossEntropy.apply(logits, targets, ignore_index, bounds)
