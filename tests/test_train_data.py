"""python -m pycomm.parallel.train on tokenized data: --tokenizer, --dataset (text, JSONL, SFT
JSONL), padded and --pack-ed batches in HuggingFace's conventions, the logging line and
--tensorboard.

The tokenizer is built here (a WordLevel over a dozen words, saved with
``PreTrainedTokenizerFast.save_pretrained``), so every token id is known and nothing is
downloaded; the data files are written in tmp_path. Batches are checked exactly against
the documents they come from; runs are subprocesses of the real command line.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")

import datasets  # noqa: E402  (the test extra; after the skip: it is the [data] extra's too)

from pycomm.parallel.job.config import parse  # noqa: E402
from pycomm.parallel.job.models import build_model, describe_model  # noqa: E402
from pycomm.parallel.train.batches import (  # noqa: E402
    IGNORE,
    Batch,
    Documents,
    packed_batch,
)
from pycomm.parallel.train.launch import main  # noqa: E402
from pycomm.parallel.train.metrics import Metrics  # noqa: E402
from pycomm.parallel.train.sources import TokenSource, load_source  # noqa: E402
from pycomm.parallel.train.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
VOCAB = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
PAD, EOS = VOCAB["<pad>"], VOCAB["<eos>"]
RTOL = 1e-4


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def save_tokenizer(folder: Path, eos: bool = True, pad: bool = True) -> Path:
    """A WordLevel tokenizer of VOCAB (whitespace-split words), saved as HF loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": "<unk>", **({"eos_token": "<eos>"} if eos else {}),
               **({"pad_token": "<pad>"} if pad else {})}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets' cache of the files read here stays in tmp_path, not in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def write_jsonl(path: Path, records: list[dict | str]) -> Path:
    """JSON lines; a str record is written as it is (a blank or broken line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def sentence(i: int, n: int) -> str:
    """``n`` words from WORDS starting at ``i``: distinct texts for distinct ``i``."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def sft_records(count: int) -> list[dict]:
    return [{"prompt": sentence(i, 2 + i % 3), "response": sentence(i + 5, 3 + i % 4)}
            for i in range(count)]


def token_source(tok_dir: Path, dataset: Path, *flags: str) -> TokenSource:
    cfg = parse(["--tokenizer", str(tok_dir), "--dataset", str(dataset), *flags])
    source = load_source(cfg)
    assert isinstance(source, TokenSource)
    return source


def documents(docs: Documents) -> list[tuple[list[int], list[int]]]:
    """Each document's tokens and targets."""
    bounds = docs.starts.tolist()
    return [(docs.tokens[a:b].tolist(), docs.targets[a:b].tolist())
            for a, b in itertools.pairwise(bounds)]


# --- documents ----------------------------------------------------------------------------


def test_targets_are_the_next_token_within_each_document():
    docs = Documents.from_lists([[5, 6, 1], [7, 1]], [[IGNORE, 6, 1], [7, 1]])
    assert docs.tokens.tolist() == [5, 6, 1, 7, 1]
    assert docs.targets.tolist() == [6, 1, IGNORE, 1, IGNORE]  # none across the boundary
    assert docs.starts.tolist() == [0, 3, 5] and len(docs) == 2 and docs.total == 5
    assert documents(docs.head(1)) == [([5, 6, 1], [6, 1, IGNORE])]
    assert documents(docs.tail(1)) == [([7, 1], [1, IGNORE])]
    assert docs.tail(1).starts.tolist() == [0, 2]


def test_a_text_file_is_a_document_per_line_each_ending_in_eos(tok_dir, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat\n\non a mat\nthe dog ran far\nand the cat\n")
    src = token_source(tok_dir, path, "--val-fraction", "0.25")
    texts = ["the cat sat", "on a mat", "the dog ran far"]  # the blank line is no document
    assert src.train.tokens.tolist() == [t for s in texts for t in [*ids(s), EOS]]
    assert src.val.tokens.tolist() == [*ids("and the cat"), EOS]  # the tail is held out
    assert src.vocab_size == len(VOCAB) and src.pad_id == PAD
    paragraphs = token_source(tok_dir, path, "--text-sample", "paragraph",
                              "--val-fraction", "0.5")
    assert documents(paragraphs.train)[0][0] == [*ids("the cat sat"), EOS]
    assert documents(paragraphs.val)[0][0] == [*ids("on a mat the dog ran far and the cat"),
                                               EOS]


def test_jsonl_documents_are_read_from_the_text_field(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": "a cat", "id": 1}, "",
                                                 {"body": "the dog ran", "id": 2}])
    src = token_source(tok_dir, path, "--text-field", "body", "--val-fraction", "0.5")
    assert documents(src.train)[0][0] == [*ids("a cat"), EOS]
    assert documents(src.val)[0][0] == [*ids("the dog ran"), EOS]


@pytest.mark.parametrize("flag", [[], ["--sft"]], ids=["detected", "--sft"])
def test_sft_records_train_the_response_only(tok_dir, tmp_path, flag):
    path = write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": "the cat", "response": "sat on a mat"},
        {"prompt": "a dog", "response": "ran"}])
    src = token_source(tok_dir, path, *flag, "--val-fraction", "0.5")
    p, r = ids("the cat"), ids("sat on a mat")
    assert documents(src.train) == [
        ([*p, *r, EOS], [IGNORE, *r, EOS, IGNORE])]  # the prompt's own targets: ignored
    assert documents(src.val) == [([*ids("a dog ran"), EOS],
                                   [IGNORE, VOCAB["ran"], EOS, IGNORE])]


# --- batches ------------------------------------------------------------------------------


def _window_of(tokens: list[int], targets: list[int], block: int,
               docs: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """The document and offset of which the row is the window, tokens and targets (found
    by search: the texts repeat words, so the tokens alone may match several)."""
    n = len(tokens)
    found = [(d, o) for d, (toks, tgts) in enumerate(docs) for o in range(len(toks) - n + 1)
             if n == min(len(toks), block) and toks[o : o + n] == tokens
             and tgts[o : o + n] == targets]
    assert found, f"row {tokens} -> {targets} is no window of a document"
    return found[0]


def test_padded_rows_are_one_document_each_right_padded(tok_dir, tmp_path):
    records = [{"text": sentence(i, 3 + 2 * (i % 5))} for i in range(30)]
    src = token_source(tok_dir, write_jsonl(tmp_path / "d.jsonl", records), "--block-size",
                       "8")
    docs, block, seen = documents(src.train), 8, set()
    for step in range(1, 6):
        b = src.train_batch(7, step, 16, block)
        assert set(b.inputs()) == {"attention_mask"} and b.position_ids is None
        assert b.tokens.shape == b.targets.shape == b.attention_mask.shape == (16, block)
        for row in range(16):
            n = int(b.attention_mask[row].sum())
            assert b.attention_mask[row].tolist() == [1] * n + [0] * (block - n)  # right
            d, o = _window_of(b.tokens[row, :n].tolist(), b.targets[row, :n].tolist(),
                              block, docs)
            assert b.tokens[row, n:].tolist() == [PAD] * (block - n)
            assert b.targets[row, n:].tolist() == [IGNORE] * (block - n)
            seen.add((d, o))
        assert b.trained_tokens() == int((b.targets != IGNORE).sum())
    assert any(o > 0 for _, o in seen)  # a longer document: windows past its head too


def test_packed_rows_restart_positions_at_each_document():
    """Documents whose tokens say where they are (document d, token i: 100 d + i), the
    first 2 labels of each ignored (an SFT prompt): every row is checked token by token."""
    lengths = [5, 3, 9, 4, 6, 2, 7]
    tokens = [[100 * d + i for i in range(n)] for d, n in enumerate(lengths)]
    labels = [[IGNORE, IGNORE, *t[2:]] for t in tokens]
    docs, block = Documents.from_lists(tokens, labels), 8
    stream = docs.tokens.tolist()
    for step in range(20):
        b = packed_batch(docs, step, 4, block)
        assert set(b.inputs()) == {"position_ids"} and b.attention_mask is None
        for row in range(4):
            toks = b.tokens[row].tolist()
            assert toks == stream[stream.index(toks[0]) :][:block]  # contiguous, no padding
            first_doc, first_index = divmod(toks[0], 100)
            for j, t in enumerate(toks):
                d, i = divmod(t, 100)
                position = i - first_index if d == first_doc else i
                target = t + 1 if 2 <= i + 1 < lengths[d] else IGNORE
                assert b.position_ids[row, j] == position, (row, j, toks)
                assert b.targets[row, j] == target, (row, j, toks)


def test_packed_sft_rows_from_files(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", sft_records(20))
    src = token_source(tok_dir, path, "--pack", "--block-size", "16")
    assert src.pad_id is None
    b = src.train_batch(3, 1, 4, 16)
    for row in range(4):
        toks, pos = b.tokens[row].tolist(), b.position_ids[row].tolist()
        # every document ends with EOS: a position restarts at 0 exactly after one
        assert [j for j, p in enumerate(pos) if p == 0] == \
               [0] + [j for j in range(1, 16) if toks[j - 1] == EOS]
        assert all(b.targets[row, j] == IGNORE for j in range(16) if toks[j] == EOS)


def test_batches_depend_on_seed_and_step_only(tok_dir, tmp_path):
    """Two ranks load the data each on their own: the same batch from (seed, step)."""
    path = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    for layout in ([], ["--pack"]):
        a, b = (token_source(tok_dir, path, "--block-size", "16", *layout) for _ in "ab")
        one, again = a.train_batch(5, 3, 4, 16), b.train_batch(5, 3, 4, 16)
        for f in dataclasses.fields(Batch):
            x, y = getattr(one, f.name), getattr(again, f.name)
            assert (x is None and y is None) or torch.equal(x, y), f.name
        assert not torch.equal(one.tokens, a.train_batch(5, 4, 4, 16).tokens)
        assert not torch.equal(one.tokens, a.train_batch(6, 3, 4, 16).tokens)
        val = a.val_batches(5, 2, 4, 16)
        assert torch.equal(val[1].tokens, b.val_batches(5, 2, 4, 16)[1].tokens)
        assert not torch.equal(val[0].tokens, val[1].tokens)


def test_the_model_vocabulary_is_the_tokenizer_s(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", sft_records(10))
    flags = ["--tokenizer", str(tok_dir), "--dataset", str(path), "--n-layer", "1",
             "--n-head", "2", "--n-embd", "16", "--block-size", "16"]
    cfg = parse(flags)
    vocab = load_source(cfg).vocab_size
    assert vocab == len(VOCAB) == len(load_tokenizer(str(tok_dir), padded=True))
    gpt = build_model(cfg, vocab)
    assert gpt.lm_head.out_features == len(VOCAB)
    assert f"vocabulary of {len(VOCAB)}" in describe_model(cfg, gpt, vocab)
    llama = build_model(parse([*flags, "--model", "llama"]), vocab)
    assert llama.get_input_embeddings().num_embeddings == len(VOCAB)


def test_a_vocabulary_tp_cannot_split_is_refused_naming_vocab_multiple(tok_dir, tmp_path):
    """13 ids cannot be split over tp=2: refused, advising --vocab-multiple, which rounds
    the model's vocabulary up (the same in every layout, so each trains the same model)."""
    path = write_jsonl(tmp_path / "sft.jsonl", sft_records(10))
    flags = ["--tokenizer", str(tok_dir), "--dataset", str(path)]
    with pytest.raises(ValueError, match=r"vocabulary \(13: .*not divisible by tp \(2\); "
                                         r"give --vocab-multiple 2"):
        load_source(parse([*flags, "--tp", "2"]))
    assert load_source(parse([*flags, "--tp", "2", "--vocab-multiple", "8"])).vocab_size == 16
    assert load_source(parse([*flags, "--vocab-multiple", "2"])).vocab_size == 14


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("lines, said", [
    ([{"text": "the cat"}, "", {"body": "a mat"}],
     ["docs.jsonl line 3 has no 'text' field (its fields: body)", "--text-field"]),
    ([{"prompt": "the", "response": "cat"}, {"prompt": "a"}],
     ["docs.jsonl line 2 has no 'response' field", "SFT records need both"]),
    ([{"text": "the cat"}, "{not json"], ["docs.jsonl line 2 is not JSON"]),
    ([{"text": "the cat"}, {"text": 5}], ["docs.jsonl line 2 has 'text' of type int, not text"]),
    (["[1, 2]"], ["docs.jsonl line 1 is not a JSON object but list"]),
], ids=["no-field", "sft-no-response", "not-json", "not-text", "not-an-object"])
def test_a_bad_record_is_named_with_its_line(tok_dir, tmp_path, lines, said):
    path = write_jsonl(tmp_path / "docs.jsonl", lines)
    with pytest.raises(ValueError) as err:
        token_source(tok_dir, path)
    for words in said:
        assert words in str(err.value)


def test_tokenizer_without_eos_or_pad_says_what_to_set(tmp_path):
    no_eos = str(save_tokenizer(tmp_path / "no_eos", eos=False))
    with pytest.raises(ValueError, match=r"no EOS token.*tokenizer\.eos_token = "):
        load_tokenizer(no_eos, padded=False)
    no_pad = str(save_tokenizer(tmp_path / "no_pad", pad=False))
    with pytest.raises(ValueError, match=r"no pad token.*tokenizer\.pad_token = .*--pack"):
        load_tokenizer(no_pad, padded=True)
    assert load_tokenizer(no_pad, padded=False).eos_token_id == EOS  # packed: no padding
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_tokenizer(str(tmp_path / "missing"), padded=True)


@pytest.mark.parametrize("flags, said", [
    (["--dataset", "d.jsonl"], "--dataset needs --tokenizer"),
    (["--tokenizer", "t"], "--tokenizer needs --dataset"),
    (["--pack", "--sft"], "--sft, --pack given without --dataset"),
    (["--vocab-multiple", "64"], "--vocab-multiple given without --dataset"),
    (["--tokenizer", "t", "--dataset", "d", "--data", "x"], "not both"),
    (["--tokenizer", "t", "--dataset", "d", "--plan", "auto"], "--plan auto sizes byte-level"),
])
def test_data_settings_that_cannot_work_are_refused(flags, said):
    with pytest.raises(ValueError, match=said):
        parse(flags)


def test_sft_of_plain_text_and_a_small_split_are_refused(tok_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat\n")
    with pytest.raises(ValueError, match="--sft reads JSON records"):
        token_source(tok_dir, text, "--sft")
    with pytest.raises(ValueError, match=r"holds 1 document; val_fraction 0\.1 holds out 0"):
        token_source(tok_dir, text)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}] * 10)
    with pytest.raises(ValueError, match=r"validation documents .* fewer than a packed row"):
        token_source(tok_dir, path, "--pack", "--block-size", "8")


def test_a_bad_dataset_is_refused_before_any_rank_starts(tok_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "the cat"}, {"txt": "a mat"}])
    assert main(["--tokenizer", str(tok_dir), "--dataset", str(path), "--dp", "2"]) == 2
    assert "docs.jsonl line 2 has no 'text' field" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "the cat"}] * 10)
    assert main(["--tokenizer", str(tok_dir), "--dataset", str(good), "--tp", "2"]) == 2
    assert "not divisible by tp (2)" in capsys.readouterr().err


# --- logging ------------------------------------------------------------------------------


def test_a_log_line_every_log_every_steps_and_at_the_end(caplog):
    caplog.set_level(logging.INFO, logger="pycomm.parallel.train")
    log = Metrics(True, "", "", False, steps=5, start=0, log_every=2)
    for step in range(1, 6):
        log.train({"step": step, "loss": 2.5 / step, "grad_norm": 0.5, "lr": 1e-3,
                   "tokens_per_s": 12345.6, "trained_tokens": 96})
    said = [r.getMessage() for r in caplog.records if r.name == "pycomm.parallel.train"]
    assert said == [f"step {s}/5 | loss {2.5 / s:.4f} | grad norm 0.5000 | lr 1.000e-03 | "
                    "12,346 tok/s | 96 trained tokens" for s in (2, 4, 5)]


# --- runs ---------------------------------------------------------------------------------

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "4", "--steps", "4", "--eval-every", "2", "--eval-batches", "2",
        "--warmup-steps", "1", "--no-progress", "--log-every", "2"]


def train(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m pycomm.parallel.train ARGS``, checked to succeed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYCOMM_TIMEOUT_S="120",
               HF_DATASETS_CACHE=str(tmp_path / "hf_cache"), HF_HUB_OFFLINE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "pycomm.parallel.train", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    return done


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def scalars(folder: Path, tag: str) -> dict[int, float]:
    """``tag``'s values by step, read back from the event files of ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def assert_board_holds(folder: Path, metrics: Path) -> None:
    """One event file (rank 0's), holding every step's loss and every validation's."""
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    for kind, tag, key in (("train", "train/loss", "loss"), ("eval", "eval/loss", "val_loss")):
        want = {r["step"]: r[key] for r in records(metrics, kind)}
        got = scalars(folder, tag)
        assert got.keys() == want.keys() != set()
        assert all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want), (got, want)


def assert_logged(done: subprocess.CompletedProcess[str], steps: tuple[int, ...]) -> None:
    said = [ln for ln in done.stderr.splitlines() if "pycomm.parallel.train: step " in ln]
    assert [ln.split("pycomm.parallel.train: step ")[1].split()[0] for ln in said] == \
           [f"{s}/4" for s in steps], done.stderr[-3000:]
    assert all("loss " in ln and "grad norm" in ln and "tok/s" in ln and "trained tokens" in ln
               for ln in said)


def test_a_byte_run_on_two_ranks_logs_and_writes_tensorboard(tmp_path, backend):
    """The byte-level trainer (the engine as it is) with the new outputs: the logging
    line every 2 steps, and rank 0's event file holding the JSONL's losses."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted((ROOT / "parallel" / "train").glob("*.py")):
        (corpus / path.name).write_bytes(path.read_bytes())
    out, board = tmp_path / "m.jsonl", tmp_path / "tb"
    done = train(tmp_path, *TINY, "--backend", backend, "--dp", "2", "--data", corpus,
                 "--metrics", out, "--tensorboard", board)
    assert_logged(done, (2, 4))
    assert all(r["trained_tokens"] == 4 * 16 for r in records(out, "train"))
    assert_board_holds(board, out)


def test_packed_sft_on_two_ranks_trains_what_one_process_trains(tok_dir, tmp_path, backend):
    """SFT JSONL, packed, dp=2 with --tensorboard: the losses of one process, step for
    step; the event file holds them; the logging line appears."""
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    common = [*TINY, "--backend", backend, "--tokenizer", tok_dir, "--dataset", data, "--pack"]
    one, two, board = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "tb"
    train(tmp_path, *common, "--metrics", one)
    done = train(tmp_path, *common, "--dp", "2", "--metrics", two, "--tensorboard", board)
    assert_logged(done, (2, 4))
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        got, want = records(two, kind), records(one, kind)
        assert [r["step"] for r in got] == [r["step"] for r in want] != []
        assert all(abs(g[key] / w[key] - 1) <= RTOL for g, w in zip(got, want, strict=True))
    trained = [r["trained_tokens"] for r in records(two, "train")]
    assert all(0 < n < 4 * 16 for n in trained)  # prompts and documents' ends are ignored
    assert records(two, "config")[0]["vocab_size"] == len(VOCAB)
    assert_board_holds(board, two)


def test_padded_text_on_two_ranks_trains_what_one_process_trains(tok_dir, tmp_path, backend):
    """Text JSONL, one padded document per row (attention_mask), dp=2 against one process."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": sentence(i, 2 + i % 9)}
                                              for i in range(40)])
    common = [*TINY, "--backend", backend, "--tokenizer", tok_dir, "--dataset", data,
              "--eval-every", "0"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    train(tmp_path, *common, "--metrics", one)
    train(tmp_path, *common, "--dp", "2", "--metrics", two)
    got, want = records(two, "train"), records(one, "train")
    assert len(got) == len(want) == 4
    assert all(abs(g["loss"] / w["loss"] - 1) <= RTOL for g, w in zip(got, want, strict=True))
