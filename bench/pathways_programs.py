"""The programs of Pathways' evidence, run and printed side by side with their references.

1. GPipe with its two stages on two islands (micro-batches as futures) against one
   process training the same layers on the same micro-batches;
2. the project's GPT on a dp2 x tp2 mesh through the controller against the same layout
   under ``python -m parallel.train``;
3. two clients on one island: with the scheduler off (they deadlock until the watchdog's
   timeout names it) and on (both finish, exact), and a 1:2 share by weight;
4. a worker killed mid-program: the error, how soon, and the other island's program.

The functions the workers run are the test suite's (``tests/_pathways_fns.py``)::

    python -m bench.pathways_programs --out bench/results/pathways/programs.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}", "OMP_NUM_THREADS": "1"}

import _pathways_fns as fns  # noqa: E402
import test_pathways as tp  # noqa: E402

from parallel import pathways as pw  # noqa: E402


def gpipe(client: pw.Client) -> dict:
    from parallel.models.gpt import synthetic_batch
    from parallel.pathways.pipeline import IslandPipeline

    micro, steps, lr, rows = 4, 5, 0.1, 2
    batches = []
    for s in range(steps):
        xs, ys = synthetic_batch(fns.GPT_CFG, micro * rows, seed=100 + s)
        batches.append((list(xs.split(rows)), list(ys.split(rows))))
    act = pw.spec((rows, fns.GPT_CFG.block_size, fns.GPT_CFG.n_embd))
    pipe = IslandPipeline(client, [client.mesh(0, (1,)), client.mesh(1, (1,))],
                          fns.gpt_stage, fns.gpt_loss, lr, activation=act)
    t0 = time.perf_counter()
    futures = [pipe.step(xs, ys) for xs, ys in batches]
    got = [sum(f.result(0) for f in step) / micro for step in futures]
    seconds = time.perf_counter() - t0
    want = [sum(s) / micro for s in tp._one_process_gpipe(micro, steps, lr, batches)]
    return {"pathways": got, "one_process": want, "seconds": seconds,
            "max_abs_diff": max(abs(g - w) for g, w in zip(got, want, strict=True))}


def trainer(four: pw.Cluster) -> dict:
    import subprocess

    from parallel.pathways.train import pw_train
    from parallel.train.config import parse

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for path in sorted((ROOT / "parallel" / "compose").glob("*.py")):
            (corpus / path.name).write_bytes(path.read_bytes())
        flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
                 "--batch-size", "4", "--steps", "6", "--warmup-steps", "2", "--no-progress",
                 "--dp", "2", "--tp", "2", "--data", str(corpus), "--eval-every", "0"]
        metrics = Path(tmp) / "m.jsonl"
        subprocess.run([sys.executable, "-m", "parallel.train", *flags, "--metrics",
                        str(metrics)], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, **ENV})
        want = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
                if r["kind"] == "train"]
        with four.client() as client:
            got = [r["loss"] for r in pw_train(client, client.mesh(0, (2, 2), ("dp", "tp")),
                                                   parse(flags))]
    return {"pathways": got, "parallel_train": want,
            "max_abs_diff": max(abs(g - w) for g, w in zip(got, want, strict=True))}


def tenancy(cluster: pw.Cluster) -> dict:
    with pw.Cluster([2], timeout_s=6, env=ENV, policy="off") as off:
        t0 = time.monotonic()
        out, clients = tp._two_clients_in_opposite_orders(off)
        off_result = {"errors": [str(f.exception()) for f in out],
                      "seconds": time.monotonic() - t0}
        for c in clients:
            c.close()
    t0 = time.monotonic()
    out, clients = tp._two_clients_in_opposite_orders(cluster)
    on = {"results": [float(f.result(0)[0]) for f in out], "seconds": time.monotonic() - t0}
    for c in clients:
        c.close()
    light, heavy = cluster.client(weight=1.0), cluster.client(weight=2.0)
    work = {}
    for c in (light, heavy):
        mesh = c.mesh(1, (2,), ranks=[0, 1])
        work[c] = [c.call(fns.spin, mesh, torch.ones(8, dtype=torch.float64), 0.01,
                          out=tp.V8) for _ in range(120)]
    for fs in work.values():
        fs[-1].wait()
    both = (max(min(s for s, _ in c.timings(fs)) for c, fs in work.items()),
            min(max(e for _, e in c.timings(fs)) for c, fs in work.items()))
    busy = {c: sum(max(0.0, min(e, both[1]) - max(s, both[0])) for s, e in c.timings(fs))
            for c, fs in work.items()}
    share = {"weights": [1, 2], "busy_s": [busy[light], busy[heavy]],
             "ratio": busy[heavy] / busy[light], "window_s": both[1] - both[0]}
    light.close()
    heavy.close()
    return {"off": off_result, "on": on, "share": share}


def killed() -> dict:
    with pw.Cluster([2, 2], timeout_s=30, env=ENV) as c, c.client(timeout_s=60) as client:
        a, b = client.mesh(0, (2,)), client.mesh(1, (2,))
        x = torch.ones(8, dtype=torch.float64)
        chains = {m.island: [client.call(fns.spin, m, x, 0.05, out=tp.V8)] for m in (a, b)}
        for _ in range(12):
            for m in (a, b):
                chains[m.island].append(client.call(fns.spin, m, chains[m.island][-1], 0.05,
                                                    out=tp.V8))
        time.sleep(0.3)
        pid = c.kill(0, 1)
        t0 = time.monotonic()
        err = str(chains[0][-1].exception())
        named_after = time.monotonic() - t0
        other = float(chains[1][-1].result(0)[0])
        t1 = time.monotonic()
        c.restart(0)
        restart_s = time.monotonic() - t1
    return {"pid": pid, "error": err, "named_after_s": named_after,
            "other_island_result": other, "other_island_expected": 2.0 ** 13,
            "restart_s": restart_s}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pathways_programs")
    p.add_argument("--out", default="bench/results/pathways/programs.json")
    a = p.parse_args()
    report: dict = {}
    with pw.Cluster([2, 2], timeout_s=60, env=ENV) as cluster:
        with cluster.client() as client:
            report["gpipe"] = gpipe(client)
        report["tenancy"] = tenancy(cluster)
    with pw.Cluster([4], timeout_s=120, env=ENV) as four:
        report["trainer"] = trainer(four)
    report["killed"] = killed()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    g, t, s, k = report["gpipe"], report["trainer"], report["tenancy"], report["killed"]
    print("GPipe, stages on islands 0 and 1, M=4: step loss pathways | one process")
    for i, (x, y) in enumerate(zip(g["pathways"], g["one_process"], strict=True)):
        print(f"  step {i + 1}: {x:.7f} | {y:.7f}")
    print(f"  max |diff| {g['max_abs_diff']:.2e}")
    print("GPT dp2 x tp2: step loss through the controller | python -m parallel.train")
    for i, (x, y) in enumerate(zip(t["pathways"], t["parallel_train"], strict=True)):
        print(f"  step {i + 1}: {x:.7f} | {y:.7f}")
    print(f"  max |diff| {t['max_abs_diff']:.2e}")
    print(f"scheduler off: {s['off']['errors'][0][:220]} ({s['off']['seconds']:.1f} s)")
    print(f"scheduler on: results {s['on']['results']} in {s['on']['seconds']:.2f} s")
    print(f"share, weights 1:2: measured {s['share']['ratio']:.3f} over "
          f"{s['share']['window_s']:.2f} s")
    print(f"killed island 0 rank 1 (pid {k['pid']}): named after {k['named_after_s']:.2f} s: "
          f"{k['error'][:160]}; island 1 finished: {k['other_island_result']} (expected "
          f"{k['other_island_expected']}); restart {k['restart_s']:.1f} s")


if __name__ == "__main__":
    main()
