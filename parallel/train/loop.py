"""One rank of the trainer: build the mesh, the model and the engine, then step, validate
and checkpoint. Every rank runs this same code on the same global batches."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..compose.parallelize import ParallelModel, parallelize
from ..job.config import TrainConfig, parallel_config
from ..job.models import VOCAB, build_model, describe_model
from ..mesh import ParallelMesh
from ..rng import seed_streams
from . import ckpt
from .batches import Batch
from .data import derive_seed
from .metrics import Metrics, peak_rss_mb
from .sources import DataSource, load_source


def build(cfg: TrainConfig, vocab: int = VOCAB) -> tuple[ParallelModel, int, str]:
    """The engine on this rank's part of the mesh, the whole model's parameter count and
    its description, for data of ``vocab`` token ids (bytes by default). The model is
    built whole from ``seed`` on every rank (or on the meta device, each rank then
    materializing its part), so every layout starts alike."""
    mesh = ParallelMesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep)
    model = build_model(cfg, vocab)
    params = sum(p.numel() for p in model.parameters())
    name = describe_model(cfg, model, vocab)
    return parallelize(model, mesh, parallel_config(cfg)), params, name


def seed_step(seed: int, step: int, mesh: ParallelMesh) -> None:
    """Seed every random stream for ``step`` from ``(seed, step)``, so a resumed run draws
    the dropout masks the uninterrupted one drew, whatever the generators' state in the
    checkpoint. :func:`pycomm.parallel.rng.seed_streams` keeps TP ranks alike on the replicated
    stream and apart on their own heads, and stages apart; the replica is mixed in here
    so that data-parallel replicas drop differently, as one process does across its rows."""
    s = derive_seed(seed, "dropout", step, mesh.rank("dp")) >> 8
    seed_streams(s, mesh.rank("tp"), mesh.rank("pp"))


def validate(engine: ParallelModel, batches: list[Batch]) -> float:
    """The mean loss over the fixed held-out batches."""
    losses = [engine.evaluate(b.tokens, b.targets, **b.inputs()) for b in batches]
    return sum(losses) / len(losses)


def _due(step: int, every: int, last: int, at_end: bool) -> bool:
    return (every > 0 and step % every == 0) or (at_end and step == last)


def train_rank(cfg: TrainConfig) -> None:
    """The whole run on this rank (the process group is up)."""
    torch.set_num_threads(cfg.threads)
    data = load_source(cfg)
    engine, params, name = build(cfg, data.vocab_size)
    start, resumed, changes = ckpt.resume(engine, cfg) if cfg.resume else (0, None, "")
    if cfg.from_pretrained and not resumed:
        engine.load_pretrained(cfg.from_pretrained)
    log = Metrics(dist.get_rank() == 0, cfg.metrics, cfg.plot_path(), cfg.progress,
                  cfg.steps, start, cfg.log_every, cfg.tensorboard)
    log.say(_banner(cfg, data, params, name))
    if resumed:
        log.say(f"resumed from {resumed} (step {start})")
    if changes:
        log.say(changes)
    if not start:
        log.record({"kind": "config", **dataclasses.asdict(cfg), "world": dist.get_world_size(),
                    "params": params, **data.record()})
    held_out = data.val_batches(cfg.seed, cfg.eval_batches, cfg.batch_size, cfg.block_size)
    for step in range(start + 1, cfg.steps + 1):
        _train_step(engine, cfg, data, step, log)
        if _due(step, cfg.eval_every, cfg.steps, at_end=cfg.eval_every > 0):
            t0 = time.perf_counter()
            loss = validate(engine, held_out)
            log.eval(step, loss, time.perf_counter() - t0)
        if _due(step, cfg.ckpt_every, cfg.steps, at_end=False):
            log.say(f"checkpoint -> {ckpt.save(engine, cfg, step)}")
    if cfg.export_hf:
        log.say(f"HuggingFace model -> {ckpt.export_hf(engine, cfg)}")
    log.close(f"{name}, {params / 1e6:.2f}M params, {describe(cfg)}")


def _train_step(engine: ParallelModel, cfg: TrainConfig, data: DataSource, step: int,
                log: Metrics) -> None:
    seed_step(cfg.seed, step, engine.mesh)
    batch = data.train_batch(cfg.seed, step, cfg.batch_size, cfg.block_size)
    t0 = time.perf_counter()
    r = engine.train_step(batch.tokens, batch.targets, **batch.inputs())
    seconds = time.perf_counter() - t0
    log.train({"step": step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
               "step_s": seconds, "tokens_per_s": batch.tokens.numel() / seconds,
               "trained_tokens": batch.trained_tokens(), "aux_loss": r.aux_loss,
               "dropped": r.dropped, "skipped": r.skipped,
               "loss_scale": r.loss_scale, "peak_rss_mb": peak_rss_mb(),
               **({"stage3": stats} if (stats := engine.stage3_stats()) else {})})


def describe(cfg: TrainConfig) -> str:
    """The layout and the strategies in a few words: ``dp2 tp2 (SP) pp2 (1f1b, M=2)...``"""
    tp = f"tp{cfg.tp}" + (" (SP)" if cfg.sequence_parallel else "")
    pp = f"pp{cfg.pp}" + (f" ({cfg.schedule}, M={cfg.effective_microbatches()})"
                          if cfg.pp > 1 else "")
    dp = f"dp{cfg.dp}" + (f" (ep{cfg.ep})" if cfg.ep > 1 else "")
    return (f"{dp} {tp} {pp} zero{cfg.zero}" + (" recompute" if cfg.recompute else "")
            + (" P_a" if cfg.partition_activations else "")
            + (" compiled" if cfg.compile else "")
            + f" {cfg.precision}, dropout {cfg.dropout}, seed {cfg.seed}")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n > 1 else "")


def _banner(cfg: TrainConfig, data: DataSource, params: int, name: str) -> str:
    return (f"train: {name}, {params / 1e6:.2f}M params | data: {data.describe()} | "
            f"{describe(cfg)} | {_ranks(dist.get_world_size())} on {cfg.backend}, "
            f"batch {cfg.batch_size}x{cfg.block_size}")
