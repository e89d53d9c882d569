"""Sparse logistic regression on a click-through-like data set through a parameter
server: each worker pulls the weights of the features its batch touches, pushes their
gradient (scaled so BSP + SGD equals one process on all workers' batches), and the
servers apply SGD.

    python -m pycomm.parallel.ps.examples.logreg --servers 2 --workers 4 --consistency ssp \\
        --tau 2 --steps 100 --metrics runs/logreg.jsonl

Each worker step writes ``{"step", "loss", "worker", "clock", "pushed_bytes",
"pulled_bytes", "t"}``; at the end worker 0 writes ``{"final_loss"}`` (the loss of the
final weights on a held-out batch) and, with ``--check``, ``{"check_diff"}``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .. import KVWorker
from ..filters import SignificanceFilter
from ._job import Metrics, job_parser, run_example
from .ctr_data import ClickData, SparseBatch
from .logreg_model import (
    loss_and_grad,
    train_one_process_state,
    worker_push_scale,
)

BIAS = torch.zeros(1, dtype=torch.int64)


def parser() -> argparse.ArgumentParser:
    p = job_parser(__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--features", type=int, default=10**6)
    p.add_argument("--density", type=float, default=1e-4, help="non-zeros per example / "
                   "features (1e-2 is the paper's regime: heavy; 1e-4 learns in ~50 steps)")
    return p


def held_out(data: ClickData) -> SparseBatch:
    return data.batch(worker=10**6, step=0, size=512)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    data = ClickData(num_features=args.features, density=args.density, seed=args.seed)
    metrics = Metrics(args.metrics)
    sgd = {"name": "sgd", "lr": args.lr}
    with KVWorker() as kv:
        kv.declare("w", 1, sgd)
        kv.declare("b", 1, sgd)
        scale = worker_push_scale(args.batch_size, args.batch_size * kv.num_workers)
        filt = SignificanceFilter(args.filter_threshold) if args.filter_threshold else None
        for step in range(args.steps):
            batch = data.batch(kv.rank, step, args.batch_size)
            before = (kv.pushed_bytes, kv.pulled_bytes)
            w_ts, b_ts = kv.pull(batch.keys, table="w"), kv.pull(BIAS, table="b")
            loss, grad_w, grad_b = loss_and_grad(batch, kv.result(w_ts), kv.result(b_ts))
            keys, values = batch.keys, grad_w * scale
            if filt is not None:
                keys, values = filt("w", keys, values)
            kv.push(keys, values, table="w", codec=args.codec)
            kv.push(BIAS, grad_b * scale, table="b")
            clock = kv.clock()
            metrics.write(step=step, loss=loss, worker=kv.rank, clock=clock,
                          pushed_bytes=kv.pushed_bytes - before[0],
                          pulled_bytes=kv.pulled_bytes - before[1])
            if kv.rank == args.slow_worker:
                time.sleep(args.slow_ms / 1000)
        if filt is not None:  # what the filter still holds is pushed at the end
            keys, values = filt.flush("w")
            if len(keys):
                kv.wait(kv.push(keys, values.reshape(len(keys), 1), table="w"))
            kv.clock()
        kv.barrier()
        if kv.rank == 0:
            report(kv, data, args, metrics)


def report(kv: KVWorker, data: ClickData, args: argparse.Namespace, metrics: Metrics) -> None:
    test = held_out(data)
    w = kv.result(kv.pull(test.keys, table="w"))
    b = kv.result(kv.pull(BIAS, table="b"))
    metrics.write(final_loss=loss_and_grad(test, w, b)[0], worker=0)
    if args.check:
        _, want_w, want_b = train_one_process_state(data, kv.num_workers, args.steps,
                                                    args.batch_size, args.lr)
        keys = torch.arange(args.features, dtype=torch.int64)
        got = kv.result(kv.pull(keys, table="w")).squeeze(1)
        diff = max(float((got - want_w).abs().max()), float((b - want_b).abs().max()))
        scale = max(float(want_w.abs().max()), 1e-30)
        metrics.write(check_diff=diff, check_scale=scale, worker=0)
        print(f"check: weights against one process trained alike: largest |difference| "
              f"{diff:.3g} (largest weight {scale:.3g})", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_example(parser(), "pycomm.parallel.ps.examples.logreg", train, argv)

if __name__ == "__main__":
    sys.exit(main())
