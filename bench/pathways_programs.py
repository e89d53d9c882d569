"""The programs of Pathways' evidence, run and printed side by side with their references.

1. GPipe with its two stages on two islands (micro-batches as futures) against one
   process training the same layers on the same micro-batches;
2. the project's GPT on a dp2 x tp2 mesh through the controller against the same layout
   under ``python -m pycomm.parallel.train``;
3. two clients on one island: with the scheduler off (they deadlock until the watchdog's
   timeout names it) and on (both finish, exact), and a 1:2 share by weight;
4. a worker killed mid-program: the error, how soon, and the other island's program.

The programs are ``bench/_pathways_programs.py`` (the tests assert on the same)::

    python -m bench.pathways_programs --out records/pathways/programs.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import _pathways_programs as programs
from pycomm.parallel import pathways as pw

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def gpipe(client: pw.Client) -> dict:
    micro = 4
    t0 = time.perf_counter()
    got, want = programs.gpipe_on_two_islands(client, micro=micro, steps=5)
    seconds = time.perf_counter() - t0
    got_mean, want_mean = ([sum(s) / micro for s in losses] for losses in (got, want))
    return {"pathways": got_mean, "one_process": want_mean, "seconds": seconds,
            "max_abs_diff": max(abs(g - w) for gs, ws in zip(got, want, strict=True)
                                for g, w in zip(gs, ws, strict=True))}


def trainer(four: pw.Cluster) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        got, want = programs.trainer_against_parallel_train(four, Path(tmp), 6, ENV)
    losses = [r["loss"] for r in got], [r["loss"] for r in want]
    return {"pathways": losses[0], "parallel_train": losses[1],
            "max_abs_diff": max(abs(g - w) for g, w in zip(*losses, strict=True))}


def tenancy(cluster: pw.Cluster) -> dict:
    with pw.Cluster([2], timeout_s=6, env=ENV, policy="off") as off:
        t0 = time.monotonic()
        out, clients = programs.two_clients_in_opposite_orders(off)
        off_result = {"errors": [str(f.exception()) for f in out],
                      "seconds": time.monotonic() - t0}
        for c in clients:
            c.close()
    t0 = time.monotonic()
    out, clients = programs.two_clients_in_opposite_orders(cluster)
    on = {"results": [float(f.result(0)[0]) for f in out], "seconds": time.monotonic() - t0}
    for c in clients:
        c.close()
    return {"off": off_result, "on": on, "share": programs.weighted_share(cluster)}


def killed() -> dict:
    with pw.Cluster([2, 2], timeout_s=30, env=ENV) as c, c.client(timeout_s=60) as client:
        seen = programs.killed_worker(c, client)
        t1 = time.monotonic()
        c.restart(0)
        restart_s = time.monotonic() - t1
    return {"pid": seen["pid"], "error": seen["error"], "named_after_s": seen["named_after_s"],
            "other_island_result": float(seen["other"][0]),
            "other_island_expected": 2.0 ** 13, "restart_s": restart_s}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pathways_programs")
    p.add_argument("--out", default="records/pathways/programs.json")
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
    print("GPT dp2 x tp2: step loss through the controller | python -m pycomm.parallel.train")
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
