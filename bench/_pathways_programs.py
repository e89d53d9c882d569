"""The programs of Pathways' evidence, shared by bench/pathways_programs.py (which prints
and keeps what they measured) and tests/test_pathways.py (which asserts on them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import _pathways_steps as fns
from pycomm.parallel import pathways as pw

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
V8 = pw.spec((8,), F64)


def gpipe_batches(micro: int, steps: int, rows: int) -> list[tuple[list, list]]:
    """Each step's micro-batches (inputs, targets) of the GPT, from fixed seeds."""
    from pycomm.parallel.models.gpt import synthetic_batch

    batches = []
    for s in range(steps):
        xs, ys = synthetic_batch(fns.GPT_CFG, micro * rows, seed=100 + s)
        batches.append((list(xs.split(rows)), list(ys.split(rows))))
    return batches


def one_process_gpipe(micro: int, lr: float, batches: list) -> list[list[float]]:
    """The same layers, micro-batches and SGD in one process: each micro-batch's loss."""
    layers = torch.nn.Sequential(*fns.gpt_layers())
    opt = torch.optim.SGD(layers.parameters(), lr=lr)
    losses = []
    for xs, ys in batches:
        step = []
        for x, y in zip(xs, ys, strict=True):
            loss = fns.gpt_loss(layers(x), y)
            (loss / micro).backward()
            step.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step)
    return losses


def gpipe_on_two_islands(client: pw.Client, micro: int, steps: int, lr: float = 0.1,
                         rows: int = 2) -> tuple[list[list[float]], list[list[float]]]:
    """Per micro-batch losses of GPipe with stages on islands 0 and 1 (every step
    dispatched at once), and of one process."""
    from pycomm.parallel.pathways.pipeline import IslandPipeline

    batches = gpipe_batches(micro, steps, rows)
    act = pw.spec((rows, fns.GPT_CFG.block_size, fns.GPT_CFG.n_embd))
    pipe = IslandPipeline(client, [client.mesh(0, (1,)), client.mesh(1, (1,))],
                          fns.gpt_stage, fns.gpt_loss, lr, activation=act)
    futures = [pipe.step(xs, ys) for xs, ys in batches]
    got = [[f.result(0) for f in step] for step in futures]
    return got, one_process_gpipe(micro, lr, batches)


def two_clients_in_opposite_orders(cluster: pw.Cluster
                                   ) -> tuple[list[pw.Future], list[pw.Client]]:
    """Two clients, one all-reduce each on the same two workers, that reach the workers
    in opposite orders: worker 0 gets client 0's first, worker 1 client 1's (with the
    scheduler on, its order wins whatever the order of arrival)."""
    clients = [cluster.client(timeout_s=60) for _ in range(2)]
    meshes = [c.mesh(0, (2,), ranks=[0, 1]) for c in clients]
    out = []
    for i, c in enumerate(clients):
        c._hold_parts = True
        out.append(c.call(fns.summed, meshes[i], torch.full((8,), i + 1.0, dtype=F64),
                          out=V8))
    if clients[0]._held_parts:  # policy off: client 0 -> worker 0, client 1 -> worker 1 ...
        for c, part in ((clients[0], 0), (clients[1], 1), (clients[0], 1), (clients[1], 0)):
            c._send_part(part)
            time.sleep(0.2)  # each part at the workers before the next leaves
    for f in out:
        f.exception(timeout=60)
    return out, clients


def weighted_share(cluster: pw.Cluster, island: int = 1, calls: int = 120,
                   seconds: float = 0.01) -> dict[str, Any]:
    """Clients of weights 1 and 2 with the same work on one mesh: the heavier one's busy
    time over the lighter one's while both had work there (the workers' clocks)."""
    light, heavy = cluster.client(weight=1.0), cluster.client(weight=2.0)
    work = {}
    for c in (light, heavy):
        mesh = c.mesh(island, (2,), ranks=[0, 1])
        work[c] = [c.call(fns.spin, mesh, torch.ones(8, dtype=F64), seconds, out=V8)
                   for _ in range(calls)]
    for fs in work.values():
        fs[-1].wait()
    both = (max(min(s for s, _ in c.timings(fs)) for c, fs in work.items()),
            min(max(e for _, e in c.timings(fs)) for c, fs in work.items()))
    busy = {c: sum(max(0.0, min(e, both[1]) - max(s, both[0])) for s, e in c.timings(fs))
            for c, fs in work.items()}
    # each call's own time in the window, to size the noise of the ratio (a loaded
    # machine stretches calls unevenly)
    inside = {c: [e - s for s, e in c.timings(fs) if s >= both[0] and e <= both[1]]
              for c, fs in work.items()}
    light.close()
    heavy.close()
    return {"ratio": busy[heavy] / busy[light], "busy_s": [busy[light], busy[heavy]],
            "window_s": both[1] - both[0], "calls_s": [inside[light], inside[heavy]]}


def killed_worker(cluster: pw.Cluster, client: pw.Client) -> dict[str, Any]:
    """A chain on each island; island 0 rank 1 killed mid-way. What the controller says,
    how soon, and island 1's result (2**13 when its chain finished right)."""
    a, b = client.mesh(0, (2,)), client.mesh(1, (2,))
    x = torch.ones(8, dtype=F64)
    chains = {m.island: [client.call(fns.spin, m, x, 0.05, out=V8)] for m in (a, b)}
    for _ in range(12):
        for m in (a, b):
            chains[m.island].append(client.call(fns.spin, m, chains[m.island][-1], 0.05,
                                                out=V8))
    time.sleep(0.3)
    pid = cluster.kill(0, 1)
    t0 = time.monotonic()
    error = str(chains[0][-1].exception(timeout=30))
    named_after = time.monotonic() - t0
    return {"pid": pid, "error": error, "named_after_s": named_after,
            "other": chains[1][-1].result(0), "meshes": (a, b)}


def trainer_against_parallel_train(four: pw.Cluster, folder: Path, steps: int,
                                   env: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """The project's GPT on a dp2 x tp2 mesh of one island, each step one call: its step
    records, and those of the same layout under ``python -m pycomm.parallel.train``."""
    from pycomm.parallel.job.config import parse
    from pycomm.parallel.pathways.train import pw_train

    corpus = folder / "corpus"
    corpus.mkdir()
    for path in sorted((ROOT / "parallel" / "compose").glob("*.py")):
        (corpus / path.name).write_bytes(path.read_bytes())
    flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
             "--batch-size", "4", "--steps", str(steps), "--warmup-steps", "2",
             "--no-progress", "--dp", "2", "--tp", "2", "--data", str(corpus),
             "--eval-every", "0"]
    metrics = folder / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "pycomm.parallel.train", *flags, "--metrics",
                           str(metrics)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env, "PYCOMM_TIMEOUT_S": "120"}, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"python -m pycomm.parallel.train: exit {done.returncode}\n"
                           + done.stdout[-3000:] + done.stderr[-3000:])
    want = [r for r in map(json.loads, metrics.read_text().splitlines())
            if r["kind"] == "train"]
    with four.client() as client:
        got = pw_train(client, client.mesh(0, (2, 2), names=("dp", "tp")), parse(flags))
    return got, want
