"""pycomm.parallel.ps request throughput, and a dense GPT step through it against torch DDP.

``python -m bench.ps_throughput`` starts one job per (servers, workers) cell with
``python -m pycomm.parallel.ps.launch --consistency async``; every worker (this module with
``--worker``) pushes and then pulls the same K keys x dim values, waits for both, and
counts rounds for ``--seconds`` after a barrier. Reported: pushes + pulls per second,
summed over workers; median of ``--repeats`` jobs per cell with their range, the cells
taken in turn so machine noise spreads over all of them.

``--gpt`` adds the dense comparison: the project's small GPT trained with plain SGD
(a) through the parameter server, BSP, every parameter pulled and every gradient pushed
each step (this module with ``--gpt-worker``), and (b) with torch DDP on gloo and on
pycomm, both in one set of ranks started by torch.multiprocessing.spawn, stepping in
turn. Same model, batch per rank and ranks; step time = median of the slowest rank's
steps after warm-up; reported as ratios, the PS job and the DDP ranks alternating
``--gpt-rounds`` times.

Writes throughput.md / .json / .png under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ps_consistency import load
from pycomm.parallel._optional import available

Row = dict[str, Any]
KEY_SPACE = 10**6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ps_throughput",
                                description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--keys", type=int, default=1024, help="K keys per request")
    p.add_argument("--dim", type=int, default=8, help="floats per key")
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per job")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpt", action="store_true", help="also the dense GPT step: PS vs DDP")
    p.add_argument("--gpt-only", action="store_true", help="only the dense GPT step")
    p.add_argument("--gpt-servers", type=int, default=2)
    p.add_argument("--gpt-ranks", type=int, default=2)
    p.add_argument("--gpt-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--gpt-steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--gpt-warmup", type=int, default=3)
    p.add_argument("--gpt-rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("records/ps"))
    p.add_argument("--worker", action="store_true", help="(inside a job) the push/pull loop")
    p.add_argument("--gpt-worker", action="store_true", help="(inside a job) the GPT loop")
    p.add_argument("--result", default="", help="(inside a job) JSON lines file to append to")
    return p.parse_args(argv)


def append(path: str, row: Row) -> None:
    """One small O_APPEND write per line: lines from several processes stay whole."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


# -- inside a job: push + pull rounds -----------------------------------------------------


def push_pull_worker(args: argparse.Namespace) -> None:
    import torch

    from pycomm.parallel.ps import KVWorker

    torch.set_num_threads(1)
    with KVWorker() as kv:
        kv.declare("bench", args.dim, {"name": "sgd", "lr": 1e-6})
        gen = torch.Generator().manual_seed(kv.rank)
        keys = torch.randperm(KEY_SPACE, generator=gen)[: args.keys].sort().values
        values = torch.randn(args.keys, args.dim, generator=gen)
        out = torch.empty(args.keys, args.dim)
        for _ in range(5):  # warm-up: connections, the servers' first rows
            _round(kv, keys, values, out)
        kv.barrier()
        rounds, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            _round(kv, keys, values, out)
            rounds += 1
        elapsed = time.perf_counter() - start
        append(args.result, {"worker": kv.rank, "ops": 2 * rounds, "seconds": elapsed})
        kv.barrier()


def _round(kv: Any, keys: Any, values: Any, out: Any) -> None:
    push = kv.push(keys, values, table="bench")
    pull = kv.pull(keys, out=out, table="bench")
    kv.wait(push)
    kv.wait(pull)


# -- inside a job: the GPT through the parameter server -----------------------------------


def gpt_config() -> Any:
    from pycomm.parallel.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)


def gpt_size() -> dict[str, int]:
    from pycomm.parallel.models import GPT

    params = list(GPT(gpt_config()).parameters())
    return {"params": sum(p.numel() for p in params), "tensors": len(params)}


def gpt_ps_worker(args: argparse.Namespace) -> None:
    import torch

    from pycomm.parallel.models import lm_loss
    from pycomm.parallel.ps import KVWorker
    from pycomm.parallel.ps.examples.dense_model import (
        flat_named_grads,
        flat_named_parameters,
        gpt_batch,
        init_gpt,
    )
    from pycomm.parallel.ps.examples.logreg_model import worker_push_scale

    torch.set_num_threads(1)
    cfg = gpt_config()
    model = init_gpt(cfg, seed=0)
    named = flat_named_parameters(model)  # views: pull_dense writes into the model
    with KVWorker() as kv:
        kv.declare_dense(named, {"name": "sgd", "lr": 0.05})
        scale = worker_push_scale(args.gpt_batch, args.gpt_batch * kv.num_workers)
        times = []
        for step in range(args.gpt_warmup + args.gpt_steps):
            start = time.perf_counter()
            kv.pull_dense(named)
            tokens, targets = gpt_batch(kv.rank, step, args.gpt_batch, cfg, seed=0)
            model.zero_grad(set_to_none=True)
            lm_loss(model(tokens), targets).backward()
            for ts in kv.push_dense({k: g * scale for k, g in flat_named_grads(model).items()}):
                kv.wait(ts)
            kv.clock()
            times.append(time.perf_counter() - start)
        append(args.result, {"worker": kv.rank, "times": times[args.gpt_warmup:]})
        kv.barrier()


# -- DDP ranks: gloo and pycomm in turn ----------------------------------------------------


def ddp_rank(rank: int, world: int, args: argparse.Namespace, result: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm  # noqa: F401  (registers the "pycomm" backend)
    from bench._ports import init_default_group
    from pycomm.parallel.models import lm_loss
    from pycomm.parallel.ps.examples.dense_model import gpt_batch, init_gpt

    torch.set_num_threads(1)
    init_default_group("pycomm", rank, world)
    groups = {"ddp-pycomm": dist.group.WORLD, "ddp-gloo": dist.new_group(backend="gloo")}
    cfg = gpt_config()
    models = {name: DDP(init_gpt(cfg, seed=0), process_group=g) for name, g in groups.items()}
    optims = {name: torch.optim.SGD(m.parameters(), lr=0.05) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.gpt_warmup + args.gpt_steps):
        tokens, targets = gpt_batch(rank, step, args.gpt_batch, cfg, seed=0)
        order = list(models) if step % 2 == 0 else list(reversed(models))
        for name in order:
            dist.barrier(group=groups[name])
            start = time.perf_counter()
            optims[name].zero_grad(set_to_none=True)
            lm_loss(models[name](tokens), targets).backward()
            optims[name].step()
            times[name].append(time.perf_counter() - start)
    append(result, {"worker": rank, **{k: v[args.gpt_warmup:] for k, v in times.items()}})
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------


def launch(servers: int, workers: int, consistency: str, worker_flags: list[str]) -> None:
    cmd = [sys.executable, "-m", "pycomm.parallel.ps.launch", "--servers", str(servers),
           "--workers", str(workers), "--consistency", consistency, "--", sys.executable, "-m",
           "bench.ps_throughput", *worker_flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"job failed ({done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def read(path: str) -> list[Row]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def throughput(args: argparse.Namespace, tmp: str) -> list[Row]:
    cells = [(int(s), int(w)) for s in args.servers.split(",") for w in args.workers.split(",")]
    runs: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    for rep in range(args.repeats):
        for s, w in cells:
            result = f"{tmp}/tp-{s}-{w}-{rep}.jsonl"
            launch(s, w, "async", ["--worker", "--keys", str(args.keys), "--dim",
                                   str(args.dim), "--seconds", str(args.seconds),
                                   "--result", result])
            rows = read(result)
            runs[(s, w)].append(sum(r["ops"] / r["seconds"] for r in rows))
            print(f"servers {s} workers {w} run {rep}: {runs[(s, w)][-1]:.0f} ops/s", flush=True)
    return [{"servers": s, "workers": w, "ops_per_s": statistics.median(v), "min": min(v),
             "max": max(v), "runs": v} for (s, w), v in runs.items()]


def gpt_compare(args: argparse.Namespace, tmp: str) -> Row:
    import torch.multiprocessing as mp

    from bench._ports import hosted_store

    per_round: dict[str, list[float]] = {"ps-bsp": [], "ddp-gloo": [], "ddp-pycomm": []}
    for rnd in range(args.gpt_rounds):
        ddp_file = f"{tmp}/ddp-{rnd}.jsonl"
        with hosted_store(args.gpt_ranks):  # the ranks inherit its port (bench._ports)
            mp.spawn(ddp_rank, args=(args.gpt_ranks, args, ddp_file), nprocs=args.gpt_ranks,
                     join=True)
        ddp = read(ddp_file)
        for name in ("ddp-gloo", "ddp-pycomm"):
            per_round[name].append(_slowest_median([r[name] for r in ddp]))
        ps_file = f"{tmp}/gpt-ps-{rnd}.jsonl"
        launch(args.gpt_servers, args.gpt_ranks, "bsp",
               ["--gpt-worker", "--gpt-batch", str(args.gpt_batch), "--gpt-steps",
                str(args.gpt_steps), "--gpt-warmup", str(args.gpt_warmup), "--result", ps_file])
        per_round["ps-bsp"].append(_slowest_median([r["times"] for r in read(ps_file)]))
        print(f"gpt round {rnd}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms"
                                              for k, v in per_round.items()), flush=True)
    return per_round


def _slowest_median(per_rank: list[list[float]]) -> float:
    return statistics.median(max(step) for step in zip(*per_rank, strict=True))


def tables(args: argparse.Namespace, rows: list[Row], gpt: Row | None) -> list[str]:
    out: list[str] = []
    if rows:
        out += [f"| servers | workers | pushes + pulls / s (median of {args.repeats}) | range | "
                "per worker |", "|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['servers']} | {r['workers']} | {r['ops_per_s']:.0f} | "
                       f"{r['min']:.0f}-{r['max']:.0f} | {r['ops_per_s'] / r['workers']:.0f} |")
    if gpt:
        med = {k: statistics.median(v) for k, v in gpt.items()}
        out += ["", "| step | median ms (over rounds) | range ms |", "|---|---|---|"]
        for k, v in gpt.items():
            out.append(f"| {k} | {med[k] * 1e3:.1f} | {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} |")
        out += ["", "| ratio (step time) | median over rounds | per round |", "|---|---|---|"]
        for a, b in (("ps-bsp", "ddp-gloo"), ("ps-bsp", "ddp-pycomm"),
                     ("ddp-gloo", "ddp-pycomm")):
            each = [x / y for x, y in zip(gpt[a], gpt[b], strict=True)]
            out.append(f"| {a} / {b} | {statistics.median(each):.2f} | "
                       f"{', '.join(f'{e:.2f}' for e in each)} |")
    return out


NOTES = """\
Reading it: on 2 CPUs, more servers means more processes sharing the same 2 cores and
each request cut into more parts (one message per server), so pushes + pulls per second
fall as servers are added; this measures per-request overhead (Python, ZeroMQ, JSON
headers), not how the servers scale on real hosts. The GPT comparison is not on equal
footing either: the PS job runs S servers and a scheduler beside its ranks on the same
cores, pulls and pushes every parameter ({params:,} floats in {tensors} tensors, one table each)
through them every step and waits at the BSP gate, whereas DDP all-reduces the
gradients between the ranks directly. The PS job and the DDP ranks alternate per round;
gloo and pycomm alternate per step within the same ranks."""


def plot(rows: list[Row], path: Path) -> bool:
    matplotlib = available("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for w in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == w]
        xs = [r["servers"] for r in mine]
        ys = [r["ops_per_s"] for r in mine]
        err = [[y - r["min"] for y, r in zip(ys, mine, strict=True)],
               [r["max"] - y for y, r in zip(ys, mine, strict=True)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{w} workers")
    ax.set_xlabel("servers")
    ax.set_xticks(sorted({r["servers"] for r in rows}))
    ax.set_ylabel("pushes + pulls per second (all workers)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        push_pull_worker(args)
        return 0
    if args.gpt_worker:
        gpt_ps_worker(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as tmp:
        rows = [] if args.gpt_only else throughput(args, tmp)
        gpt = gpt_compare(args, tmp) if args.gpt or args.gpt_only else None
    cfg = gpt_config()
    md = ["# parallel.ps throughput (bench/ps_throughput.py)", "",
          f"Push + pull rounds of {args.keys} keys x {args.dim} floats (async), "
          f"{args.seconds:g} s timed per job, {os.cpu_count()} CPUs: every cell runs "
          "1 scheduler + S servers + W workers on them, so all are oversubscribed. "
          f"Load average before: {load_before}; after: {load()}.", ""]
    if gpt:
        md += [f"GPT step: GPTConfig(vocab {cfg.vocab_size}, block {cfg.block_size}, "
               f"{cfg.n_layer} layers, {cfg.n_head} heads, embd {cfg.n_embd}), batch "
               f"{args.gpt_batch} per rank, {args.gpt_ranks} ranks, SGD; PS: BSP with "
               f"{args.gpt_servers} servers (pull all, push all, clock), DDP: gloo and pycomm "
               f"in the same spawned ranks, alternating per step; {args.gpt_steps} timed "
               f"steps after {args.gpt_warmup} per round, {args.gpt_rounds} rounds.", ""]
    md += [*tables(args, rows, gpt), "", NOTES.format(**gpt_size()), ""]
    (args.out / "throughput.md").write_text("\n".join(md))
    (args.out / "throughput.json").write_text(json.dumps(
        {"push_pull": rows, "gpt_step_s": gpt, "keys": args.keys, "dim": args.dim}, indent=1))
    if rows:
        plot(rows, args.out / "throughput.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
