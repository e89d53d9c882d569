"""Batches of tokenized documents, in HuggingFace's conventions, drawn from (seed, step).

The documents of a split lie end to end in one :class:`Documents`; every token has its
target already shifted: the next token of the same document, or ``IGNORE`` (-100) at a
document's last token (nothing of it predicts the next document) and wherever the next
token is not trained (an SFT prompt). Two layouts:

- :func:`padded_batch`: one document per row, right-padded to ``block`` with the pad
  token (targets ``IGNORE`` and ``attention_mask`` 0 there); a longer document gives a
  window of ``block`` tokens at an offset drawn with the row.
- :func:`packed_batch`: rows of ``block`` tokens cut from the documents end to end at
  drawn offsets; no padding, ``position_ids`` restart at 0 at each document (as HF's
  ``DataCollatorWithFlattening``), so attention can stay inside it. A row that starts
  inside a document starts its positions at 0 too, as a window in the padded layout does.

A batch depends on ``(seed, step)`` alone (the caller derives ``seed``), as the byte
batches of :mod:`pycomm.parallel.train.data` do: every rank draws the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # HuggingFace's ignore_index: a target no loss is taken on


@dataclass(frozen=True)
class Batch:
    """A global batch: what ``engine.train_step`` and ``engine.evaluate`` take."""

    tokens: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def inputs(self) -> dict[str, torch.Tensor]:
        """The keywords the engine takes beside tokens and targets: only those this
        layout has (a byte batch has none, and is called as before)."""
        given = {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        return {name: value for name, value in given.items() if value is not None}

    def trained_tokens(self) -> int:
        """The targets the loss counts (not ``IGNORE``)."""
        return int((self.targets != IGNORE).sum())


@dataclass(frozen=True)
class Documents:
    """Documents end to end: document ``d`` is ``tokens[starts[d]:starts[d + 1]]``."""

    tokens: torch.Tensor  # int64 [N]
    targets: torch.Tensor  # int64 [N]: the next token in the document, or IGNORE
    starts: torch.Tensor  # int64 [D + 1]: each document's first index, then N

    @classmethod
    def from_lists(cls, ids: list[list[int]], labels: list[list[int]]) -> Documents:
        """From each document's tokens and labels (HF's unshifted labels: the token
        itself, or ``IGNORE`` where it is not trained)."""
        targets = [lab[1:] + [IGNORE] for lab in labels]
        lengths = torch.tensor([0] + [len(doc) for doc in ids], dtype=torch.long)
        return cls(_flat(ids), _flat(targets), torch.cumsum(lengths, 0))

    def __len__(self) -> int:
        return self.starts.numel() - 1

    @property
    def total(self) -> int:
        return self.tokens.numel()

    def head(self, count: int) -> Documents:
        """The first ``count`` documents."""
        end = int(self.starts[count])
        return Documents(self.tokens[:end], self.targets[:end], self.starts[: count + 1])

    def tail(self, count: int) -> Documents:
        """The last ``count`` documents."""
        first = len(self) - count
        begin = int(self.starts[first])
        return Documents(self.tokens[begin:], self.targets[begin:],
                         self.starts[first:] - begin)


def _flat(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t for row in rows for t in row], dtype=torch.long)


def padded_batch(docs: Documents, seed: int, batch: int, block: int, pad_id: int) -> Batch:
    """``batch`` documents drawn from ``seed``, one per row, right-padded to ``block``."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(docs), (batch,), generator=gen).tolist()
    shifts = torch.rand(batch, generator=gen, dtype=torch.float64).tolist()
    tokens = torch.full((batch, block), pad_id, dtype=torch.long)
    targets = torch.full((batch, block), IGNORE, dtype=torch.long)
    mask = torch.zeros((batch, block), dtype=torch.long)
    for row, (doc, shift) in enumerate(zip(picks, shifts, strict=True)):
        begin, end = int(docs.starts[doc]), int(docs.starts[doc + 1])
        # A longer document: a window at an offset drawn with the row, so every part of
        # it is trained on over the steps, not only its head.
        begin += int(shift * (max(end - begin - block, 0) + 1))
        take = min(end - begin, block)
        tokens[row, :take] = docs.tokens[begin : begin + take]
        targets[row, :take] = docs.targets[begin : begin + take]
        mask[row, :take] = 1
    return Batch(tokens, targets, attention_mask=mask)


def packed_batch(docs: Documents, seed: int, batch: int, block: int) -> Batch:
    """``batch`` rows of ``block`` tokens at offsets drawn from ``seed``, with each
    token's position in its document (from the row's start for the first one)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, docs.total - block + 1, (batch, 1), generator=gen)
    index = offsets + torch.arange(block)
    doc = torch.searchsorted(docs.starts, index, right=True) - 1
    positions = torch.where(doc == doc[:, :1], index - offsets, index - docs.starts[doc])
    return Batch(docs.tokens[index], docs.targets[index], position_ids=positions)
