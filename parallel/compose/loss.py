"""The loss of one process on any batch, in every layout.

One process computes ``F.cross_entropy(logits, targets, ignore_index=-100)`` over the
global batch: the sum of the per-token losses over the count of tokens that are not
ignored. A layout splits that batch over data-parallel replicas and micro-batches whose
rows hold different counts of such tokens (prompts masked in SFT, padding), so the mean
of their means is not the one process's loss (HuggingFace's Trainer fixed this in 2024
with ``num_items_in_batch``; torchtitan and Megatron-LM divide by the global count).

So each micro-batch's backward starts from its *share* of the global loss: its sum over
the global count, times ``dp`` (the data-parallel reduction averages over the replicas),
and the shares add up to the one process's loss and gradients in every layout:

- the default loss (cross-entropy; vocab-parallel where the logits are split over the
  vocabulary): the count is known before the step, from the global targets that every
  rank holds;
- a ``loss_fn`` returning ``(sum, count)``: the count is known only after the last
  forward, so each share is its sum over the batch's target elements, and the complete
  gradients (and the loss) are rescaled by ``elements / count`` after one all-reduce of
  the counts (:meth:`StepLoss.finish`);
- a ``loss_fn`` returning one value: its micro-batch's mean, weighted by the
  micro-batch's rows (the user's own normalisation, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor.parallel_linear import vocab_parallel_cross_entropy
from .chunked_loss import chunked_cross_entropy


def not_ignored(targets: torch.Tensor, ignore_index: int) -> int:
    """How many targets the loss counts."""
    return int((targets != ignore_index).sum())


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                         tp_group: Any | None) -> torch.Tensor:
    """The sum of the per-token cross-entropies of the targets that are not ignored
    (``tp_group``: the logits are split over the vocabulary on that group)."""
    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits, targets, tp_group, ignore_index).sum()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


@dataclass
class StepLoss:
    """One step's (or one evaluation's) loss function for the pipeline: each call returns
    a micro-batch's share of the global loss (see the module docstring).

    Args:
        custom: ``config.loss_fn`` (None: the cross-entropy).
        ignore_index: targets the cross-entropy skips.
        tp_group: the group the logits are split over, or None.
        replicas: the data-parallel size.
        global_count: the global batch's targets that are not ignored.
        elements: the global batch's target elements.
        replica_rows: this replica's rows (a mean loss is weighted by its share of them).
        pair_refusal: why a (sum, count) pair cannot be taken (empty: it can).
        vocab_bounds: a tiled head's vocabulary chunks, the cross-entropy's (None:
            taken whole).
    """

    custom: Callable[[torch.Tensor, torch.Tensor], Any] | None
    ignore_index: int
    tp_group: Any | None
    replicas: int
    global_count: int
    elements: int
    replica_rows: int
    pair_refusal: str = ""
    vocab_bounds: list[tuple[int, int]] | None = None
    counts: list[float] = field(default_factory=list)  # the (sum, count) form's counts

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.chunked:
            assert self.vocab_bounds is not None
            total = chunked_cross_entropy(logits, targets, self.ignore_index, self.vocab_bounds)
            return total * (self.replicas / max(self.global_count, 1))
        if self.custom is None:
            total = summed_cross_entropy(logits, targets, self.ignore_index, self.tp_group)
            return total * (self.replicas / max(self.global_count, 1))
        out = self.custom(logits, targets)
        if isinstance(out, (tuple, list)):
            if self.pair_refusal:
                raise ValueError(self.pair_refusal)
            total, count = _checked_pair(out)
            self.counts.append(count)
            return total * (self.replicas / max(self.elements, 1))
        return out * (targets.shape[0] / self.replica_rows)

    @property
    def chunked(self) -> bool:
        """The default loss over a tiled head: taken in its vocabulary chunks."""
        return self.custom is None and self.vocab_bounds is not None

    def finish(self, is_counter: bool) -> tuple[float, int]:
        """After every micro-batch: the factor the shares still need (``elements /
        count`` for the (sum, count) form, else 1) and the global count. Collective over
        the world when ``custom`` is set: ``is_counter`` is true on the ranks whose counts
        add up to the global one (the last pipeline stage's first TP rank of each replica).
        """
        if self.custom is None:
            return 1.0, self.global_count
        local = torch.tensor([sum(self.counts), float(bool(self.counts))], dtype=torch.float64)
        if not is_counter:
            local.zero_()
        dist.all_reduce(local)
        if local[1] == 0:  # the loss function returned its mean
            return 1.0, self.global_count
        count = float(local[0])
        return self.elements / max(count, 1.0), round(count)


def _checked_pair(out: Any) -> tuple[torch.Tensor, float]:
    if len(out) != 2 or not torch.is_tensor(out[0]):
        raise TypeError(f"parallelize: loss_fn returned a {type(out).__name__} of "
                        f"{len(out)}; it returns the mean loss, or a (sum, count) pair whose "
                        "sum is a tensor")
    count = out[1]
    return out[0], float(count.detach() if torch.is_tensor(count) else count)
