"""Byte-level text that every machine has, and batches drawn from (seed, step) alone.

The corpus is the Python standard library's own ``.py`` sources (installed packages
excluded), or the file / folder given as ``--data``: files in sorted order, their bytes
concatenated, so every rank on every machine builds the same array with no download.
Its tail is held out for validation.

A step's batch depends only on ``(seed, step)``: its own generator picks the offsets. Every
rank draws the same global batch (the engine hands each data-parallel replica its rows),
so every layout trains on what one process trains on, and a resumed run continues with
exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

_INSTALLED = {"site-packages", "dist-packages"}  # third-party code, not the stdlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same in every process (``hash()`` of a str is
    salted per process, so it cannot be used)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by their path inside it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [p for p in root.rglob("*.py")
             if p.is_file() and not _INSTALLED & set(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or every non-hidden file under the folder ``path``, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"train data: {path} is neither a file nor a folder")
    found = [p for p in path.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def read_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, concatenated, as uint8; files holding a NUL byte (binary)
    are left out."""
    chunks = [b for b in (p.read_bytes() for p in files) if b"\0" not in b]
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@dataclass
class Corpus:
    """The training and the held-out bytes."""

    train: torch.Tensor
    val: torch.Tensor
    source: str

    @property
    def size(self) -> int:
        return self.train.numel() + self.val.numel()


def load_corpus(data: str, val_fraction: float, block_size: int) -> Corpus:
    """The corpus of ``--data`` (empty: the standard library), its tail held out."""
    files = text_files(Path(data)) if data else stdlib_files()
    source = data or f"Python {sysconfig.get_python_version()} standard library"
    everything = read_bytes(files)
    n_val = int(everything.numel() * val_fraction)
    corpus = Corpus(everything[: everything.numel() - n_val], everything[-n_val:]
                    if n_val else everything[:0], f"{source} ({len(files)} files)")
    for part, name in ((corpus.train, "training"), (corpus.val, "validation")):
        if part.numel() < block_size + 2:
            raise ValueError(f"train data: the {name} part of {corpus.source} holds "
                             f"{part.numel()} bytes, fewer than block_size + 2 "
                             f"({block_size + 2}); give more text or a smaller block_size")
    return corpus


def draw(data: torch.Tensor, seed: int, batch: int, block: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``data`` at offsets drawn from ``seed``: tokens and their
    next-byte targets, as int64."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - block - 1, (batch, 1), generator=gen)
    windows = data[starts + torch.arange(block + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def train_batch(corpus: Corpus, seed: int, step: int, batch: int, block: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (1-based), from ``(seed, step)`` alone."""
    return draw(corpus.train, derive_seed(seed, "train", step), batch, block)


def val_batches(corpus: Corpus, seed: int, count: int, batch: int, block: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches every validation uses."""
    return [draw(corpus.val, derive_seed(seed, "val", i), batch, block) for i in range(count)]
