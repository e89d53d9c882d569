"""The project's GPT trained through a parameter server: each parameter is a table (its
name) cut into blocks spread over the servers; each step a worker pulls every
parameter, runs its batch of the Python standard library's bytes (or random tokens
with ``--random-tokens``), and pushes its gradient scaled so BSP + SGD equals one
process on all workers' batches.

    python -m pycomm.parallel.ps.examples.dense --servers 2 --workers 2 --consistency bsp \\
        --steps 30 --metrics runs/dense.jsonl --check
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ...models import GPTConfig, lm_loss
from .. import KVWorker
from ._job import Metrics, job_parser, run_example
from .dense_model import (
    flat_named_grads,
    flat_named_parameters,
    gpt_batch,
    init_gpt,
    train_one_process_gpt_state,
)
from .logreg_model import worker_push_scale


def parser() -> argparse.ArgumentParser:
    p = job_parser(__doc__.splitlines()[0] if __doc__ else "")
    p.set_defaults(lr=0.1, batch_size=4, steps=30)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--random-tokens", action="store_true", help="uniform tokens (nothing to "
                   "learn) instead of the standard library's bytes")
    return p


def config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)


def corpus_of(args: argparse.Namespace) -> torch.Tensor | None:
    if args.random_tokens:
        return None
    from ...train.data import load_corpus

    return load_corpus("", 0.1, args.block_size).train


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cfg, corpus = config(args), corpus_of(args)
    metrics = Metrics(args.metrics)
    model = init_gpt(cfg, args.seed)
    with KVWorker() as kv:
        params = dict(model.named_parameters())  # as docs/parameter-server.md has it
        kv.declare_dense(params, {"name": "sgd", "lr": args.lr})
        scale = worker_push_scale(args.batch_size, args.batch_size * kv.num_workers)
        for step in range(args.steps):
            before = (kv.pushed_bytes, kv.pulled_bytes)
            kv.pull_dense(params)  # into the parameters themselves
            tokens, targets = gpt_batch(kv.rank, step, args.batch_size, cfg, args.seed, corpus)
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model(tokens), targets)
            loss.backward()
            kv.push_dense({n: g * scale for n, g in flat_named_grads(model).items()},
                          codec=args.codec)
            clock = kv.clock()
            metrics.write(step=step, loss=loss.item(), worker=kv.rank, clock=clock,
                          pushed_bytes=kv.pushed_bytes - before[0],
                          pulled_bytes=kv.pulled_bytes - before[1])
            if kv.rank == args.slow_worker:
                time.sleep(args.slow_ms / 1000)
        kv.barrier()
        if kv.rank == 0 and args.check:
            kv.pull_dense(params)
            _, want = train_one_process_gpt_state(cfg, kv.num_workers, args.steps,
                                                  args.batch_size, args.lr, args.seed, corpus)
            ref = flat_named_parameters(want)
            diff = max(float((params[n].detach().view(-1) - ref[n]).abs().max()) for n in ref)
            metrics.write(check_diff=diff, worker=0)
            print(f"check: parameters against one process trained alike: largest "
                  f"|difference| {diff:.3g}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_example(parser(), "pycomm.parallel.ps.examples.dense", train, argv)

if __name__ == "__main__":
    sys.exit(main())
