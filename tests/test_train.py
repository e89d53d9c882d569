"""python -m pycomm.parallel.train: its settings, its data, and short runs that must train what one
process trains, in every way the trainer is launched (in-process, --nproc, torchrun).

Runs are subprocesses of the real command line on a tiny GPT over a small folder of text
(the project's own sources, copied), so each costs seconds on a shared 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.layouts import parse_layout, plan
from pycomm.parallel.job.config import TrainConfig, build_parser, parse, read_toml
from pycomm.parallel.job.schedule import WarmupCosine
from pycomm.parallel.train.data import (
    derive_seed,
    load_corpus,
    read_bytes,
    stdlib_files,
    text_files,
    train_batch,
    val_batches,
)
from pycomm.parallel.train.launch import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "4", "--steps", "5", "--eval-every", "5", "--eval-batches", "2",
        "--warmup-steps", "2", "--no-progress"]
STEP_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "peak_rss_mb"}
RTOL = 1e-4

# --- settings -----------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


def test_toml_then_flags(tmp_path):
    path = _toml(tmp_path, "[model]\nn_layer = 3\n[training]\nlr = 1\nsteps = 7\n"
                           "[parallel]\ndp = 2\nrecompute = true\n")
    cfg = parse(["--config", str(path), "--steps", "9", "--no-recompute"])
    assert (cfg.n_layer, cfg.lr, cfg.dp) == (3, 1.0, 2)  # from the file (lr: int -> float)
    assert (cfg.steps, cfg.recompute) == (9, False)  # flags win
    assert cfg.n_embd == TrainConfig().n_embd  # neither: the default


def test_every_flag_has_a_toml_key(tmp_path):
    """A TOML file of every field (non-default values) reads back to the same config as
    the same values given as flags."""
    fields = {f.name: f for f in TrainConfig.__dataclass_fields__.values()}
    values = {"data": "x", "schedule": "gpipe", "backend": "gloo", "zero": 2}
    tables: dict[str, list[str]] = {}
    flags = []
    for name, f in fields.items():
        v = values.get(name, not f.default if isinstance(f.default, bool) else
                       f.default if isinstance(f.default, str) else f.default + 1)
        tables.setdefault(f.metadata["table"], []).append(f"{name} = {json.dumps(v)}")
        flag = "--" + name.replace("_", "-")
        flags += [flag] if v is True else [f"--no-{flag[2:]}"] if v is False else [flag, str(v)]
    text = "".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())
    from_file = read_toml(_toml(tmp_path, text))
    assert set(from_file) == set(fields)
    assert from_file == vars(build_parser().parse_args(flags))


def test_example_config_names_every_setting_at_its_default():
    path = ROOT / "examples" / "train_gpt.toml"
    assert set(read_toml(path)) == set(TrainConfig.__dataclass_fields__)
    assert parse(["--config", str(path)]) == TrainConfig()


def test_unknown_keys_and_wrong_types_are_named(tmp_path):
    path = _toml(tmp_path, "[model]\nn_layers = 3\n[bogus]\nx = 1\n[training]\n"
                           "steps = 'ten'\ndp = 2\n")
    with pytest.raises(ValueError) as err:
        parse(["--config", str(path)])
    for named in ("model.n_layers", "bogus", "training.dp", "training.steps must be int"):
        assert named in str(err.value)


def test_bad_mesh_is_the_mesh_error_before_any_rank_starts(capsys):
    assert main(["--dp", "2", "--tp", "2", "--nproc", "2"]) == 2
    assert "pp(1) * dp(2) * tp(2) = 4 != WORLD_SIZE(2)" in capsys.readouterr().err


def test_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match=r"batch_size\(6\).*dp\(4\)"):
        parse(["--batch-size", "6", "--dp", "4"])


@pytest.mark.parametrize("saving", [["--ckpt-every", "2", "--ckpt-dir", "c"],
                                    ["--resume", "--ckpt-dir", "c"],
                                    ["--model", "llama", "--export-hf", "out"]])
def test_an_offloaded_run_saves_with_clipping_and_bf16(saving):
    """Checkpoints and the HuggingFace export of an offloaded run stream through its
    unit store: accepted with the ordinary recipe (tests/test_offload_checkpoint.py
    checks what they hold)."""
    flags = ["--offload", "disk", "--offload-dir", "o", "--zero", "3", "--precision", "bf16",
             "--max-grad-norm", "1.0", "--microbatches", "2", "--batch-size", "4", "--dp", "2"]
    cfg = parse(flags + saving)
    assert cfg.offload == "disk" and cfg.precision == "bf16"


# --- data ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """A small corpus folder: the project's own top-level parallel/*.py files."""
    folder = tmp_path_factory.mktemp("corpus")
    for path in sorted((ROOT / "parallel").glob("*.py")):
        shutil.copy(path, folder / path.name)
    return folder


def test_batches_depend_on_seed_and_step_only(text_dir):
    corpus = load_corpus(str(text_dir), 0.1, 16)
    a, b = train_batch(corpus, 1, 5, 4, 16), train_batch(corpus, 1, 5, 4, 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], train_batch(corpus, 1, 6, 4, 16)[0])
    assert not torch.equal(a[0], train_batch(corpus, 2, 5, 4, 16)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets: the next bytes
    val = val_batches(corpus, 1, 2, 4, 16)
    assert torch.equal(val[0][0], val_batches(corpus, 1, 2, 4, 16)[0][0])
    # Salted hash() would differ between processes; this value must not.
    assert derive_seed(1337, "train", 1) == 8929785472188192312


def test_stdlib_corpus_is_found():
    files = stdlib_files()
    assert "os.py" in {f.name for f in files}
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files, key=lambda f: f.as_posix())  # one order everywhere
    corpus = load_corpus("", 0.1, 128)
    assert corpus.size > 1_000_000 and corpus.val.numel() > 100_000
    assert b"def " in bytes(corpus.train[:200_000].tolist())


def test_data_folder_and_file(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"bbbb")
    (tmp_path / "a.txt").write_bytes(b"aaaa")
    (tmp_path / ".hidden").write_bytes(b"hhhh")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    assert bytes(read_bytes(text_files(tmp_path)).tolist()) == b"aaaabbbb"
    assert bytes(read_bytes(text_files(tmp_path / "b.txt")).tolist()) == b"bbbb"
    with pytest.raises(FileNotFoundError):
        text_files(tmp_path / "missing")
    with pytest.raises(ValueError, match="fewer than block_size"):
        load_corpus(str(tmp_path), 0.5, 16)


def test_warmup_cosine():
    lam = WarmupCosine(steps=12, warmup=2, min_ratio=0.1)
    assert [lam(0), lam(1)] == [0.5, 1.0]
    assert math.isclose(lam(11), 0.1)
    decay = [lam(i) for i in range(1, 12)]
    assert decay == sorted(decay, reverse=True)


def test_layouts_plan_is_dp_tp_pp():
    assert parse_layout("2x1x4") == (2, 1, 4)  # dp, tp, pp
    runs = plan([(4, 1, 1), (1, 2, 2)], [0, 1, 2, 3])
    assert runs == [(1, 1, 1, 0), (4, 1, 1, 0), (4, 1, 1, 1), (4, 1, 1, 2), (4, 1, 1, 3),
                    (1, 2, 2, 0)]


# --- runs ---------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYCOMM_TIMEOUT_S="120")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def train(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m pycomm.parallel.train ARGS``, checked to succeed."""
    done = _run([sys.executable, "-m", "pycomm.parallel.train", *map(str, args)])
    assert done.returncode == 0, f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    return done


def lines(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def assert_same_run(path: Path, reference: Path, steps: range | None = None) -> None:
    """The same training and validation losses, step for step, within RTOL."""
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        got, want = lines(path, kind), lines(reference, kind)
        if steps is not None:
            got = [r for r in got if r["step"] in steps]
            want = [r for r in want if r["step"] in steps]
        assert [r["step"] for r in got] == [r["step"] for r in want] != []
        for g, w in zip(got, want, strict=True):
            assert abs(g[key] - w[key]) <= RTOL * abs(w[key]), (kind, g["step"], g, w)


@pytest.fixture(scope="module")
def tiny(backend) -> list[str]:
    """The tiny run's flags, on the backend under test (conftest: pycomm, or gloo)."""
    return [*TINY, "--backend", backend]


@pytest.fixture(scope="module")
def one_process(tiny, text_dir, tmp_path_factory
                ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The reference: the tiny run in one process (with its progress bar)."""
    out = tmp_path_factory.mktemp("one") / "m.jsonl"
    done = train(*tiny, "--progress", "--data", text_dir, "--metrics", out)
    return out, done


def test_one_process_run_writes_lines_bar_and_plot(one_process):
    out, done = one_process
    steps = lines(out, "train")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(set(r) >= STEP_KEYS for r in steps)
    assert [r["step"] for r in lines(out, "eval")] == [5]
    assert lines(out, "config")[0]["world"] == 1
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns
    assert "tok_s=" in done.stderr  # the tqdm bar
    assert out.with_suffix(".png").stat().st_size > 0


def test_spawned_ranks_train_what_one_process_trains(one_process, tiny, text_dir, tmp_path):
    """--nproc 4 on tp=2 x pp=2 (Megatron layers, a 1F1B pipeline of 2 micro-batches)."""
    out = tmp_path / "m.jsonl"
    done = train(*tiny, "--tp", "2", "--pp", "2", "--nproc", "4", "--data", text_dir,
                 "--metrics", out)
    assert lines(out, "config")[0]["world"] == 4, done.stdout
    assert_same_run(out, one_process[0])


def test_torchrun_ranks_train_what_one_process_trains(one_process, tiny, text_dir, tmp_path):
    out = tmp_path / "m.jsonl"
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "-m", "pycomm.parallel.train", *tiny, "--dp", "2",
                 "--data", str(text_dir), "--metrics", str(out)])
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert lines(out, "config")[0]["world"] == 2
    assert_same_run(out, one_process[0])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_train_what_one_process_trains(one_process, tiny, text_dir, tmp_path, zero):
    out = tmp_path / "m.jsonl"
    train(*tiny, "--dp", "2", "--zero", str(zero), "--data", text_dir, "--metrics", out)
    assert_same_run(out, one_process[0])


def test_engine_refusal_is_its_own_message(tiny):
    done = _run([sys.executable, "-m", "pycomm.parallel.train", *tiny, "--sequence-parallel"])
    assert done.returncode == 2
    assert "sequence_parallel needs tp > 1" in done.stderr


def test_layouts_table_compares_with_one_process(tiny, text_dir, tmp_path):
    out = tmp_path / "layouts.md"
    done = _run([sys.executable, "-m", "bench.layouts", "--layouts", "2x1x1", "--zero", "0",
                 *tiny, "--data", str(text_dir), "--steps", "3", "--out", str(out)])
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    rows = [r.split("|")[1:-1] for r in out.read_text().splitlines() if r.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1x1x1", "2x1x1"]
    assert all(float(r[3]) <= RTOL for r in rows[1:])


# --- resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_in, resumed_in, dropout", [
    (["--dp", "2", "--tp", "2"], ["--tp", "2", "--pp", "2"], "0"),
    (["--dp", "2", "--tp", "2", "--zero", "2"], [], "0"),
    (["--dp", "2", "--zero", "3"], ["--dp", "2", "--zero", "1"], "0"),
    ([], [], "0.1"),
], ids=["2x2x1-to-1x2x2", "2x2x1-zero2-to-1x1x1", "2x1x1-zero3-to-2x1x1-zero1",
        "1x1x1-to-1x1x1-dropout"])
def test_resume_continues_the_uninterrupted_run(tiny, text_dir, tmp_path, saved_in, resumed_in,
                                                dropout):
    """Save at step 3 of 6; resume in another layout (or, with dropout, in the same one):
    steps 4-6 equal the uninterrupted run's, and the metrics file reads as one run."""
    ck, full, resumed = tmp_path / "ck", tmp_path / "full.jsonl", tmp_path / "res.jsonl"
    run = [*tiny, "--steps", "6", "--eval-every", "3", "--dropout", dropout, "--data",
           text_dir, "--ckpt-dir", ck]
    train(*run, *saved_in, "--ckpt-every", "3", "--metrics", full)
    shutil.rmtree(ck / "step_000006")
    shutil.copy(full, resumed)
    done = train(*run, *resumed_in, "--resume", "--metrics", resumed)
    assert "resumed from" in done.stdout + done.stderr
    assert [r["step"] for r in lines(resumed, "train")] == list(range(1, 7))
    assert_same_run(resumed, full, steps=range(4, 7))


def test_resume_without_a_checkpoint_is_refused(tiny, tmp_path):
    done = _run([sys.executable, "-m", "pycomm.parallel.train", *tiny, "--resume", "--ckpt-dir",
                 str(tmp_path / "none")])
    assert done.returncode == 2 and "holds no complete checkpoint" in done.stderr


def test_a_resumed_run_follows_its_own_schedule(tiny, text_dir, tmp_path):
    """A run of 5 steps resumed with --steps 10 and another --lr: steps 6-10 take the
    learning rates a fresh 10-step run at that --lr takes there, and the trainer says so
    in one line. Before: the saved schedule went on (steps 6-10 at the old rate)."""
    ck, short, longer = tmp_path / "ck", tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    run = [*tiny, "--data", text_dir, "--eval-every", "0", "--ckpt-dir", ck]
    train(*run, "--ckpt-every", "5", "--metrics", short)
    done = train(*run, "--steps", "10", "--lr", "0.003", "--resume", "--metrics", longer)
    fresh = tmp_path / "fresh.jsonl"
    train(*tiny, "--data", text_dir, "--eval-every", "0", "--steps", "10", "--lr", "0.003",
          "--metrics", fresh)
    got = {r["step"]: r["lr"] for r in lines(longer, "train")}
    want = {r["step"]: r["lr"] for r in lines(fresh, "train")}
    assert all(math.isclose(got[s], want[s], rel_tol=1e-12) for s in range(6, 11)), (got, want)
    said = [ln for ln in (done.stdout + done.stderr).splitlines() if "schedule continues" in ln]
    assert len(said) == 1 and "steps 5 -> 10" in said[0] and "lr 0.001 -> 0.003" in said[0], said


HF_TINY = ["--model", "llama", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
           "--block-size", "16", "--batch-size", "4", "--steps", "4", "--eval-every", "0",
           "--warmup-steps", "2", "--no-progress"]


def test_a_huggingface_model_trains_on_a_mesh_as_in_one_process(text_dir, tmp_path, backend):
    """--model llama on dp x tp x pp = 1 x 2 x 2 trains what one process trains;
    --export-hf writes a folder transformers loads."""
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    one, mesh = tmp_path / "one.jsonl", tmp_path / "mesh.jsonl"
    common = [*HF_TINY, "--backend", backend, "--data", text_dir]
    train(*common, "--metrics", one)
    train(*common, "--tp", "2", "--pp", "2", "--metrics", mesh, "--export-hf", tmp_path / "hf")
    got, want = lines(mesh, "train"), lines(one, "train")
    assert all(abs(g["loss"] / w["loss"] - 1) < RTOL for g, w in zip(got, want, strict=True))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"


def test_meta_init_bf16_and_buckets_train(tiny, text_dir, tmp_path):
    """--init meta (each rank materializes its part) with ZeRO-3 trains what --init meta
    trains in one process; --precision bf16 --bucket-mb 0.01 runs and learns."""
    one, mesh, low = tmp_path / "one.jsonl", tmp_path / "mesh.jsonl", tmp_path / "bf16.jsonl"
    common = [*tiny, "--data", text_dir, "--eval-every", "0", "--init", "meta"]
    train(*common, "--metrics", one)
    train(*common, "--dp", "2", "--zero", "3", "--metrics", mesh)
    got, want = lines(mesh, "train"), lines(one, "train")
    assert all(abs(g["loss"] / w["loss"] - 1) < RTOL for g, w in zip(got, want, strict=True))
    train(*tiny, "--data", text_dir, "--eval-every", "0", "--dp", "2", "--zero", "2",
          "--precision", "bf16", "--bucket-mb", "0.01", "--metrics", low)
    steps = lines(low, "train")
    assert steps[-1]["loss"] < steps[0]["loss"] and not any(s["skipped"] for s in steps)
