"""An ordinary HuggingFace model beyond memory, trained with the recipe people use.

``python -m bench.offload_recipe`` (needs root for the cgroup, ~25 minutes, ~60 GB of
free disk under ``--dir``): a Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers,
vocabulary 32000, untied head; 16.4 GiB of fp32 Adam state), built on the meta device
from its config, through ``python -m pycomm.parallel.train`` with the whole process tree
(launcher included) in one cgroup capped at ``--cap-gib``:

1. ``offload``: dp=2, ZeRO-3 offloaded to disk, bf16, clipping 1.0, 2 micro-batches, a
   checkpoint at step 2, 3 steps;
2. ``in memory``: the same without offload (and without the checkpoint);
3. ``resumed``: the step-2 checkpoint resumed at dp=1, offloaded, for the third step,
   then exported as a HuggingFace folder;
4. the export loaded by ``from_pretrained`` (uncapped): its logits on a held-out batch
   against the engine's (fp32, dp=1, offloaded, from the export's checkpoint).

Each run's exit, OOM kills, cgroup peak, largest per-rank peak RSS, step times and
(rank 0's) bytes read and written go to ``records/offload/recipe-1b.json`` and a
table to ``recipe-1b.md``.

``--fit G [G ...]``: instead, the offloaded run (2 steps) with ``--memory-gb G`` and no
``--offload-prefetch``, ``--max-live-mb`` or ``--max-unit-mb`` of its own (the trainer
picks them to fit, :mod:`pycomm.parallel.planner.fit`), capped at what ``G`` promises: two ranks
of ``G`` each plus three processes' runtime (two ranks and the launcher, measured here
as the resident memory of a process that imported torch, transformers and pycomm) — and whether it
fits, or is refused before any rank starts (``recipe-1b-fit.{json,md}``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench._memcap import available, run_capped
from bench._provenance import write_report
from pycomm.parallel._optional import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "records", "offload")
GIB = 2**30
TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
             "bos_token_id": 1, "eos_token_id": 2}
SMOKE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
RECIPE = ["--init", "meta", "--zero", "3", "--precision", "bf16", "--max-grad-norm", "1.0",
          "--microbatches", "2", "--batch-size", "4", "--block-size", "64",
          "--threads", "1", "--log-every", "1", "--no-progress"]
LIVE_MB = "700"  # ZeRO-3's budget per rank: about four blocks' bf16 gathers


def _trainer(config: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pycomm.parallel.train", "--model", f"hf:{config}", *RECIPE,
            *args]


def _run(name: str, cmd: list[str], cap: int, metrics: str, timeout_s: float) -> dict[str, Any]:
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    run = run_capped(cmd, cap, timeout_s, cwd=ROOT, whole_tree=True)
    steps = _read_metrics(metrics)
    last = steps[-1] if steps else {}
    stage3 = last.get("stage3", {})
    out = {"name": name, **run.summary(), "steps": [s["step"] for s in steps],
           "step_s": [round(s["step_s"], 1) for s in steps],
           "loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
           "peak_rss_gib": last.get("peak_rss_mb", 0) / 1024,
           "bytes_read": stage3.get("bytes_read"), "bytes_written": stage3.get("bytes_written"),
           "max_records": stage3.get("max_records"), "held_back": stage3.get("held_back"),
           "pool_peak_bytes": stage3.get("pool_peak_bytes"), "stderr_tail": run.stderr[-1500:]}
    print(json.dumps({k: v for k, v in out.items() if k != "stderr_tail"}), flush=True)
    return out


def _read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "train"]


def _logits_check(work: str, export: str) -> dict[str, Any]:
    """The export through ``from_pretrained`` against the engine on its checkpoint."""
    from pycomm.testing import run_ranks

    engine_logits, tokens = run_ranks(_engine_logits, 1, work, timeout_s=3000.0)[0]
    import torch

    transformers = require("transformers", "bench.offload_recipe")
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        hf = model(tokens).logits
    diff = (hf - engine_logits).abs()
    return {"max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / engine_logits.abs().clamp_min(1e-6)).max()),
            "logit_scale": float(engine_logits.abs().max()), "shape": list(hf.shape)}


def _engine_logits(work: str) -> Any:
    import torch

    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    transformers = require("transformers", "bench.offload_recipe")
    config = transformers.AutoConfig.from_pretrained(work)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):  # each unit materialized just before it is sharded
        model = transformers.AutoModelForCausalLM.from_config(config)
    mesh = ParallelMesh(pp=1, dp=1, tp=1)
    engine = parallelize(model, mesh, ParallelConfig(
        zero=3, offload="disk", offload_dir=os.path.join(work, "check-offload")))
    engine.load(os.path.join(work, "hf.checkpoint"))
    tokens = torch.randint(0, TINYLLAMA["vocab_size"], (2, 32),
                           generator=torch.Generator().manual_seed(0))
    logits = engine.logits(tokens)
    mesh.destroy()
    return logits, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/pycomm-recipe-1b", help="work folder")
    parser.add_argument("--cap-gib", type=float, default=6.0)
    parser.add_argument("--name", default="recipe-1b")
    parser.add_argument("--skip-in-memory", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="instead: the offloaded "
                        "run (2 steps, no checkpoint, uncapped) at prefetch 0, 1 and 2: "
                        "step time against the I/O threads' busy time and the read waits")
    parser.add_argument("--fit", type=float, nargs="*", default=None, help="instead: the "
                        "offloaded run with --memory-gb G for each G, capped at what it "
                        "promises (see the module docstring)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model of width "
                        "256 (the same runs, in a minute: a check of this script)")
    args = parser.parse_args()
    model = {**TINYLLAMA, **(SMOKE if args.smoke else {})}
    if reason := available():
        raise SystemExit(f"bench.offload_recipe: {reason}")
    work, cap = args.dir, int(args.cap_gib * GIB)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    config = os.path.join(work, "config.json")
    with open(config, "w") as f:
        json.dump(model, f)
    if args.overlap:
        _overlap(work, config, args.name)
        return
    if args.fit is not None:
        _fit(work, config, args.name, args.fit)
        return
    runs = [_run("offload", _trainer(config, [
        "--dp", "2", "--offload", "disk", "--offload-dir", os.path.join(work, "off"),
        "--offload-prefetch", "1", "--max-live-mb", LIVE_MB, "--steps", "3",
        "--ckpt-every", "2", "--ckpt-dir", os.path.join(work, "ckpt"),
        "--metrics", os.path.join(work, "offload.jsonl")]), cap,
        os.path.join(work, "offload.jsonl"), 3000.0)]
    shutil.rmtree(os.path.join(work, "ckpt", "step_3"), ignore_errors=True)  # resume at 2
    if not args.skip_in_memory:
        runs.append(_run("in memory", _trainer(config, [
            "--dp", "2", "--steps", "3", "--metrics", os.path.join(work, "memory.jsonl")]),
            cap, os.path.join(work, "memory.jsonl"), 1200.0))
    runs.append(_run("resumed dp=1", _trainer(config, [
        "--dp", "1", "--offload", "disk", "--offload-dir", os.path.join(work, "off1"),
        "--offload-prefetch", "1", "--max-live-mb", LIVE_MB, "--steps", "3", "--resume",
        "--ckpt-dir", os.path.join(work, "ckpt"), "--export-hf", os.path.join(work, "hf"),
        "--metrics", os.path.join(work, "resumed.jsonl")]), cap,
        os.path.join(work, "resumed.jsonl"), 3000.0))
    check = _logits_check(work, os.path.join(work, "hf"))
    print(json.dumps(check), flush=True)
    result = {"cap_bytes": cap, "model": model, "recipe": RECIPE, "live_mb": LIVE_MB,
              "runs": runs, "export_logits": check}
    out = os.path.join(RESULTS, f"{args.name}.json")
    write_report(result, out)  # with the commit, versions and CPU
    Path(out).with_suffix(".md").write_text(_table(result))
    print(_table(result))


def _overlap(work: str, config: str, name: str) -> None:
    """Prefetch 0, 1, 2: the second step's time, the I/O threads' busy time, the waits."""
    rows = []
    for depth in (0, 1, 2):
        metrics = os.path.join(work, f"overlap{depth}.jsonl")
        cmd = _trainer(config, ["--dp", "2", "--offload", "disk", "--offload-dir",
                                os.path.join(work, f"off{depth}"), "--offload-prefetch",
                                str(depth), "--max-live-mb", LIVE_MB, "--steps", "2",
                                "--metrics", metrics])
        run = _run(f"prefetch {depth}", cmd, 64 * GIB, metrics, 3000.0)
        steps = _read_metrics(metrics)
        first, second = (s.get("stage3", {}) for s in steps[:2])
        rows.append({**run, "depth": depth, "per_step": {  # step 2 alone (counters grow)
            k: second.get(k, 0) - first.get(k, 0)
            for k in ("io_s", "read_wait_s", "write_wait_s", "step_s")}})
        shutil.rmtree(os.path.join(work, f"off{depth}"), ignore_errors=True)
    out = os.path.join(RESULTS, f"{name}-overlap.json")
    write_report({"rows": rows}, out)
    lines = ["TinyLlama-shaped HF Llama (1.1B), dp=2, ZeRO-3 offloaded to disk, bf16, "
             "clipping 1.0, 2 micro-batches, batch 4x64; step 2 (rank 0's I/O threads)", "",
             "| prefetch | step s | I/O busy s | read wait s | write wait s | unit steps s | "
             "cgroup peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["per_step"]
        lines.append(f"| {r['depth']} | {r['step_s'][-1]} | {p['io_s']:.1f} | "
                     f"{p['read_wait_s']:.1f} | {p['write_wait_s']:.1f} | {p['step_s']:.1f} | "
                     f"{r['max_usage_bytes'] / GIB:.2f} |")
    table = "\n".join(lines) + "\n"
    Path(out).with_suffix(".md").write_text(table)
    print(table)


def _runtime_bytes() -> int:
    """Resident bytes of a fresh process that imported what a rank imports."""
    code = ("import torch, transformers, pycomm, pycomm.parallel.train.loop, re; print(re.search("
            "r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1]) * 1024


def _fit(work: str, config: str, name: str, limits: list[float]) -> None:
    """The offloaded recipe under --memory-gb G, capped at 2 G plus 3 runtimes."""
    runtime = _runtime_bytes()
    rows = []
    for limit in limits:
        metrics = os.path.join(work, f"fit{limit}.jsonl")
        cmd = _trainer(config, ["--dp", "2", "--offload", "disk", "--offload-dir",
                                os.path.join(work, f"fit{limit}"), "--memory-gb", str(limit),
                                "--steps", "2", "--metrics", metrics])
        cap = int(2 * limit * GIB) + 3 * runtime
        run = _run(f"--memory-gb {limit}", cmd, cap, metrics, 3000.0)
        said = [line for line in run["stderr_tail"].splitlines()
                if line.startswith(("memory:", "error:"))]
        rows.append({**run, "memory_gb": limit, "cap_bytes": cap, "said": said})
        shutil.rmtree(os.path.join(work, f"fit{limit}"), ignore_errors=True)
    out = os.path.join(RESULTS, f"{name}-fit.json")
    write_report({"runtime_bytes": runtime, "rows": rows}, out)
    lines = ["TinyLlama-shaped HF Llama (1.1B), dp=2, ZeRO-3 offloaded to disk, bf16, "
             "clipping 1.0, 2 micro-batches, batch 4x64, 2 steps, with `--memory-gb G` and "
             "no read-ahead, budget or tiles of its own; the whole tree capped at 2 G + 3 runtimes "
             f"(a process's runtime measured here: {runtime / GIB:.2f} GiB)", "",
             "| --memory-gb | cap GiB | the trainer said | exit | OOM kills | cgroup peak "
             "GiB | held at most GiB (both ranks and launcher) | largest rank peak RSS GiB "
             "| step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        said = "<br>".join(r["said"]) or "-"
        lines.append(f"| {r['memory_gb']:g} | {r['cap_bytes'] / GIB:.2f} | {said} | "
                     f"{r['returncode']} | {r['oom_kills']} | {r['max_usage_bytes'] / GIB:.2f} "
                     f"| {r.get('peak_held_bytes', 0) / GIB:.2f} | {r['peak_rss_gib']:.2f} | "
                     f"{r['step_s'] or '-'} |")
    table = "\n".join(lines) + "\n"
    Path(out).with_suffix(".md").write_text(table)
    print(table)


def _table(result: dict[str, Any]) -> str:
    lines = [f"TinyLlama-shaped HF Llama (1.1B), whole process tree capped at "
             f"{result['cap_bytes'] / GIB:.2f} GiB (cgroup v1 memory.limit_in_bytes), bf16, "
             "clipping 1.0, 2 micro-batches, batch 4x64",
             "",
             "| run | exit | OOM kills | cgroup peak GiB | held at most GiB (anonymous + "
             "shared) | largest rank peak RSS GiB | steps | step s | loss | GB read | "
             "GB written |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        gb = [f"{r[k] / 1e9:.1f}" if r.get(k) else "-" for k in ("bytes_read", "bytes_written")]
        lines.append(f"| {r['name']} | {r['returncode']} | {r['oom_kills']} | "
                     f"{r['max_usage_bytes'] / GIB:.2f} | "
                     f"{r.get('peak_held_bytes', 0) / GIB:.2f} | {r['peak_rss_gib']:.2f} | "
                     f"{r['steps'] or '-'} | {r['step_s'] or '-'} | "
                     f"{[round(x, 4) for x in r['loss']] or '-'} | {gb[0]} | {gb[1]} |")
    c = result["export_logits"]
    lines += ["", "The cgroup peak counts the page cache of the checkpoint's files, which the "
              "kernel takes back under the cap (failcnt); held: the processes' anonymous and "
              "shared memory, the most sampled every 0.2 s.", "",
              f"Export reloaded by from_pretrained: logits {c['shape']} against the "
              f"engine's (fp32, dp=1, offloaded, from the export's checkpoint): max abs "
              f"difference {c['max_abs_diff']:.3g} (largest logit {c['logit_scale']:.3g}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
