"""The trainer's HuggingFace tokenizer (``--tokenizer NAME_OR_PATH``), checked for the
special tokens the batches need: an EOS token ends every document, and the padded
layout fills its rows with the pad token (``--pack`` needs none)."""

from __future__ import annotations

from typing import Any

from .._optional import require


def load_tokenizer(name: str, padded: bool) -> Any:
    """``AutoTokenizer.from_pretrained(name)``, checked (see :func:`check_special_tokens`).

    Raises:
        ValueError: the tokenizer cannot be loaded, or lacks a token the layout needs.
    """
    transformers = require("transformers", "pycomm.parallel.train's --tokenizer")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:  # transformers' "not found" is an OSError
        raise ValueError(f"train: --tokenizer {name!r} cannot be loaded: {err}") from err
    check_special_tokens(tokenizer, name, padded)
    return tokenizer


def check_special_tokens(tokenizer: Any, name: str, padded: bool) -> None:
    """Raises ValueError naming the missing token and how to give the tokenizer one."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"train: tokenizer {name!r} has no EOS token (eos_token is None), which ends "
            "every document: set one of its tokens (tokenizer.eos_token = '</s>'), "
            "save_pretrained(DIR) and pass --tokenizer DIR")
    if padded and tokenizer.pad_token_id is None:
        raise ValueError(
            f"train: tokenizer {name!r} has no pad token (pad_token is None), which fills "
            "the padded rows: set one (tokenizer.pad_token = tokenizer.eos_token is usual; "
            "padding is masked and never trained), save_pretrained(DIR) and pass "
            "--tokenizer DIR, or pack the documents with --pack")


def model_vocab(tokenizer: Any, multiple: int, tp: int) -> int:
    """The model's vocabulary: every id the tokenizer can give (added tokens included),
    rounded up to a multiple of ``multiple`` (``--vocab-multiple``).

    Raises:
        ValueError: ``tp`` does not divide it (tensor parallelism splits the embedding
            and the head over the vocabulary).
    """
    size = -(-len(tokenizer) // multiple) * multiple
    if size % tp:
        raise ValueError(f"train: the model's vocabulary ({size}: the tokenizer's "
                         f"{len(tokenizer)}, rounded up to a multiple of --vocab-multiple "
                         f"{multiple}) is not divisible by tp ({tp}); give --vocab-multiple "
                         f"{tp} or a multiple of it (e.g. 64; the extra ids are never in the "
                         "data)")
    return size
