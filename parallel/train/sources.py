"""Where the trainer's batches come from: bytes (``--data``, vocabulary 256) or a
tokenized dataset (``--dataset`` with ``--tokenizer``, padded or ``--pack``-ed rows).

Both give the loop the same thing: a :class:`~pycomm.parallel.train.batches.Batch` per step from
``(seed, step)`` alone, fixed held-out batches, the model's vocabulary, and what the
banner and the metrics' config line say about the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..job.config import TrainConfig
from ..job.models import VOCAB
from .batches import Batch, Documents, packed_batch, padded_batch
from .data import Corpus, derive_seed, load_corpus, train_batch, val_batches
from .hf_data import hold_out, read_records, tokenize
from .tokenizer import load_tokenizer, model_vocab


class DataSource(Protocol):
    vocab_size: int

    def train_batch(self, seed: int, step: int, batch: int, block: int) -> Batch: ...

    def val_batches(self, seed: int, count: int, batch: int, block: int) -> list[Batch]: ...

    def describe(self) -> str: ...

    def record(self) -> dict[str, Any]: ...


@dataclass
class ByteSource:
    """The byte corpus of :mod:`pycomm.parallel.train.data`, as it always was."""

    corpus: Corpus
    vocab_size: int = VOCAB

    def train_batch(self, seed: int, step: int, batch: int, block: int) -> Batch:
        return Batch(*train_batch(self.corpus, seed, step, batch, block))

    def val_batches(self, seed: int, count: int, batch: int, block: int) -> list[Batch]:
        return [Batch(*b) for b in val_batches(self.corpus, seed, count, batch, block)]

    def describe(self) -> str:
        c = self.corpus
        return (f"{c.source}, {c.size / 1e6:.1f} MB, {c.val.numel() / 1e6:.1f} MB held out")

    def record(self) -> dict[str, Any]:
        return {"corpus": self.corpus.source, "corpus_bytes": self.corpus.size}


@dataclass
class TokenSource:
    """Tokenized documents: one padded document per row (``pad_id``), or packed rows
    (``pad_id`` None)."""

    train: Documents
    val: Documents
    pad_id: int | None
    vocab_size: int
    source: str

    def _draw(self, docs: Documents, seed: int, batch: int, block: int) -> Batch:
        if self.pad_id is None:
            return packed_batch(docs, seed, batch, block)
        return padded_batch(docs, seed, batch, block, self.pad_id)

    def train_batch(self, seed: int, step: int, batch: int, block: int) -> Batch:
        return self._draw(self.train, derive_seed(seed, "train", step), batch, block)

    def val_batches(self, seed: int, count: int, batch: int, block: int) -> list[Batch]:
        return [self._draw(self.val, derive_seed(seed, "val", i), batch, block)
                for i in range(count)]

    def describe(self) -> str:
        layout = "packed" if self.pad_id is None else "padded"
        return (f"{self.source}, {_count(len(self.train) + len(self.val), 'document')}, "
                f"{_count(self.train.total + self.val.total, 'token')} "
                f"({_count(len(self.val), 'document')} held out), {layout} rows")

    def record(self) -> dict[str, Any]:
        return {"corpus": self.source, "corpus_documents": len(self.train) + len(self.val),
                "corpus_tokens": self.train.total + self.val.total,
                "vocab_size": self.vocab_size}


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def load_source(cfg: TrainConfig) -> DataSource:
    """The data of ``cfg``: its tokenized dataset, or its bytes."""
    if not cfg.dataset:
        return ByteSource(load_corpus(cfg.data, cfg.val_fraction, cfg.block_size))
    tokenizer = load_tokenizer(cfg.tokenizer, padded=not cfg.pack)
    records = read_records(cfg.dataset, cfg.text_field, cfg.text_sample, cfg.sft)
    kind = "SFT, " if records.responses is not None else ""
    source = f"{cfg.dataset} ({kind}tokenizer {cfg.tokenizer})"
    train, val = hold_out(tokenize(tokenizer, records), cfg.val_fraction, cfg.block_size,
                          cfg.pack, source)
    pad = None if cfg.pack else int(tokenizer.pad_token_id)
    return TokenSource(train, val, pad, model_vocab(tokenizer, cfg.vocab_multiple, cfg.tp),
                       source)


def check_source(cfg: TrainConfig) -> None:
    """Refuse a tokenizer or dataset the run cannot use before any rank starts: the
    tokenizer's special tokens, the vocabulary's split over tp, and every record
    (ValueError naming what is wrong)."""
    if cfg.dataset:
        model_vocab(load_tokenizer(cfg.tokenizer, padded=not cfg.pack), cfg.vocab_multiple,
                   cfg.tp)
        read_records(cfg.dataset, cfg.text_field, cfg.text_sample, cfg.sft)
