"""``--dataset``: local files read with HuggingFace ``datasets``, tokenized into documents.

- ``.txt``: a document per line, per paragraph or per file (``--text-sample``, datasets'
  ``sample_by``); blank documents are left out.
- ``.jsonl`` / ``.json``: a record per document, its text in ``--text-field``; or SFT
  records with ``prompt`` and ``response`` (``--sft``, or found by the fields), where
  only the response is trained.

Every document ends with the tokenizer's EOS token. A record without its field, or not
text, is refused before any step, naming its file and line: when datasets refuses a file
or a field is missing, the file is read again line by line to find the record (datasets'
own error names neither). Documents are held out from the tail, as the byte corpus holds
out its tail, so every rank builds the same two splits.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._optional import require
from .batches import IGNORE, Documents

KINDS = {".txt": "text", ".jsonl": "json", ".json": "json"}  # suffix -> datasets' builder
SFT_FIELDS = ("prompt", "response")
_CHUNK = 1024  # texts per tokenizer call: batched for speed, bounded for memory


@dataclass(frozen=True)
class Records:
    """The texts of the documents; with ``responses``, SFT pairs (texts are prompts)."""

    texts: list[str]
    responses: list[str] | None = None


def dataset_files(path: Path) -> list[Path]:
    """``path`` itself, or the dataset files of the folder ``path`` (sorted), one kind."""
    if path.is_file():
        found = [path]
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in KINDS)
    else:
        raise FileNotFoundError(f"train data: --dataset {path} is neither a file nor a folder")
    if not found or any(p.suffix not in KINDS for p in found):
        raise ValueError(f"train data: --dataset {path} holds no {', '.join(KINDS)} files")
    if len({KINDS[p.suffix] for p in found}) > 1:
        raise ValueError(f"train data: --dataset {path} mixes plain text and JSON files; "
                         "give one kind")
    return found


def _load(path: Path, text_sample: str) -> Any:
    """The file as a ``datasets.Dataset``."""
    datasets = require("datasets", "pycomm.parallel.train's --dataset")
    datasets.disable_progress_bars()  # the trainer's own output stays readable
    kind = KINDS[path.suffix]
    extra = {"sample_by": text_sample} if kind == "text" else {}
    return datasets.load_dataset(kind, data_files=str(path), split="train", **extra)


def _problem(record: Any, fields: tuple[str, ...]) -> str:
    """What is wrong with a JSON record that must hold ``fields`` as text ('' if nothing)."""
    if not isinstance(record, dict):
        return f"is not a JSON object but {type(record).__name__}"
    for name in fields:
        if record.get(name) is None:
            return f"has no {name!r} field (its fields: {', '.join(record) or 'none'})"
        if not isinstance(record[name], str):
            return f"has {name!r} of type {type(record[name]).__name__}, not text"
    return ""


def _bad_line(path: Path, fields: tuple[str, ...], hint: str) -> str:
    """The first line of the JSON lines ``path`` that is not a JSON object holding
    ``fields`` as text, and what is wrong with it ('' if none is)."""
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():  # skipped, as datasets skips it
                continue
            try:
                problem = _problem(json.loads(line), fields)
            except json.JSONDecodeError as err:
                problem = f"is not JSON ({err.msg})"
            if problem:
                return f"train data: {path} line {number} {problem}; {hint}"
    return ""


def _bad_record(path: Path, table: Any, fields: tuple[str, ...], hint: str) -> str:
    """The first bad record, by line for JSON lines (datasets skips blank lines, so its
    row numbers are not line numbers), by number for a .json file ('' if none is)."""
    if path.suffix == ".jsonl":
        return _bad_line(path, fields, hint)
    if table is None:  # a .json file datasets could not read: its own error says why
        return ""
    for number, row in enumerate(table.to_list(), 1):
        if problem := _problem(row, fields):
            return f"train data: {path} record {number} {problem}; {hint}"
    return ""


def _load_json(path: Path, fields: tuple[str, ...], hint: str) -> Any:
    try:
        return _load(path, "line")
    except Exception as err:  # datasets' own error names neither the line nor the field
        raise ValueError(_bad_record(path, None, fields, hint)
                         or f"train data: datasets cannot read {path}: {err}") from err


def _json_columns(path: Path, fields: tuple[str, ...], hint: str) -> dict[str, list[str]]:
    """``fields`` of every record of ``path``, each checked to be text."""
    table = _load_json(path, fields, hint)
    columns = {name: list(table[name]) for name in fields if name in table.column_names}
    complete = len(columns) == len(fields)
    if not complete or not all(isinstance(v, str) for c in columns.values() for v in c):
        raise ValueError(_bad_record(path, table, fields, hint)
                         or f"train data: {path} has no field {fields} in any record; {hint}")
    return columns


SFT_HINT = "SFT records need both 'prompt' and 'response' as text"
TEXT_HINT = "name the text's field with --text-field, or give SFT records 'prompt' and 'response'"


def _json_fields(path: Path, text_field: str, sft: bool) -> tuple[tuple[str, ...], str]:
    """The fields every record must hold and the hint for one that does not: SFT's with
    ``--sft`` or when the first file's records hold both, else ``text_field``."""
    if not sft:
        # a file datasets cannot read is left to the load that follows: it names the line
        with contextlib.suppress(Exception):
            sft = set(SFT_FIELDS) <= set(_load(path, "line").column_names)
    return (SFT_FIELDS, SFT_HINT) if sft else ((text_field,), TEXT_HINT)


def read_records(dataset: str, text_field: str, text_sample: str, sft: bool) -> Records:
    """Every document's text (or prompt and response) of ``--dataset``, checked."""
    files = dataset_files(Path(dataset))
    if KINDS[files[0].suffix] == "text":
        if sft:
            raise ValueError(f"train data: --sft reads JSON records with {SFT_FIELDS}; "
                             f"{files[0]} is plain text")
        texts = [t for p in files for t in _load(p, text_sample)["text"]]
        return Records([t for t in texts if t.strip()])
    fields, hint = _json_fields(files[0], text_field, sft)
    columns = [_json_columns(p, fields, hint) for p in files]
    if fields == SFT_FIELDS:
        return Records([t for c in columns for t in c["prompt"]],
                       [t for c in columns for t in c["response"]])
    return Records([t for c in columns for t in c[text_field] if t.strip()])


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of each text (``special``: with the tokenizer's BOS and the like)."""
    out: list[list[int]] = []
    for i in range(0, len(texts), _CHUNK):
        # verbose=False: a document longer than model_max_length is fine, the batches cut it
        out += tokenizer(texts[i : i + _CHUNK], add_special_tokens=special,
                         verbose=False)["input_ids"]
    return out


def tokenize(tokenizer: Any, records: Records) -> Documents:
    """The records as documents ending in EOS; an SFT prompt's tokens are not trained."""
    eos = int(tokenizer.eos_token_id)
    firsts = _encode(tokenizer, records.texts, special=True)
    if records.responses is None:
        ids = [doc if doc[-1:] == [eos] else [*doc, eos] for doc in firsts]
        return Documents.from_lists(ids, ids)
    answers = _encode(tokenizer, records.responses, special=False)
    ids = [[*p, *a, eos] for p, a in zip(firsts, answers, strict=True)]
    labels = [[IGNORE] * len(p) + [*a, eos] for p, a in zip(firsts, answers, strict=True)]
    return Documents.from_lists(ids, labels)


def hold_out(docs: Documents, val_fraction: float, block: int, packed: bool, source: str
             ) -> tuple[Documents, Documents]:
    """The training documents and the held-out tail (``val_fraction`` of them).

    Raises:
        ValueError: a split without a document, or (packed) shorter than a row.
    """
    n_val = int(len(docs) * val_fraction)
    if not 0 < n_val < len(docs):
        held = f"{len(docs)} document" + ("" if len(docs) == 1 else "s")
        raise ValueError(f"train data: {source} holds {held}; val_fraction "
                         f"{val_fraction} holds out {n_val} of them, and each split needs one "
                         "or more: give more documents or another --val-fraction")
    train, val = docs.head(len(docs) - n_val), docs.tail(n_val)
    for part, name in ((train, "training"), (val, "validation")):
        if packed and part.total < block:
            raise ValueError(f"train data: the {name} documents of {source} hold "
                             f"{part.total} tokens, fewer than a packed row (block_size "
                             f"{block}); give more text or a smaller block_size")
    return train, val
