"""The project's trainer (``python -m pycomm.parallel.train``) driven from the controller.

The engine (the ``parallelize``d model and its optimizer) is built once on every worker
of a mesh and stays there, a future the controller holds; each training step is then one
call on that mesh, every step dispatched before the first has run. The steps are the
trainer's own (``pycomm.parallel.train.loop``), so a run here is the run ``python -m
pycomm.parallel.train`` makes with the same settings, step for step.

Example::

    cfg = parse(["--dp", "2", "--tp", "2", "--steps", "20"])
    mesh = client.mesh(island=0, shape=(2, 2), names=("dp", "tp"))
    for record in pw_train(client, mesh, cfg):
        print(record["step"], record["loss"])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compose.parallelize import ParallelModel
from ..job.config import TrainConfig
from ..train.data import Corpus, load_corpus, train_batch
from ..train.loop import build, seed_step
from .client import Client, Mesh
from .mesh_context import MeshContext


@dataclass
class _Run:
    """What stays on a worker between steps."""

    engine: ParallelModel
    corpus: Corpus
    cfg: TrainConfig


def _check_mesh(ctx: MeshContext, cfg: TrainConfig) -> None:
    """The trainer builds its (pp, dp, tp) mesh over the island's group: the mesh must be
    all of the island, in order, and the layout's world."""
    world = dist.get_world_size()
    if ctx.ranks != tuple(range(world)):
        raise ValueError(f"pathways train: the mesh (ranks {list(ctx.ranks)}) must be the "
                         f"whole island ({world} workers, in order): the trainer's "
                         "ParallelMesh spans its island's process group")
    cfg.layout.check_world(world)


def build_run(ctx: MeshContext, cfg: TrainConfig) -> _Run:
    _check_mesh(ctx, cfg)
    torch.set_num_threads(cfg.threads)
    corpus = load_corpus(cfg.data, cfg.val_fraction, cfg.block_size)
    engine, _, _ = build(cfg)
    return _Run(engine, corpus, cfg)


def train_step(ctx: MeshContext, run: _Run, step: int) -> dict[str, Any]:
    """One step of the trainer's loop (``pycomm.parallel.train.loop._train_step``'s work)."""
    cfg = run.cfg
    seed_step(cfg.seed, step, run.engine.mesh)
    tokens, targets = train_batch(run.corpus, cfg.seed, step, cfg.batch_size, cfg.block_size)
    r = run.engine.train_step(tokens, targets)
    return {"step": step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr}


def pw_train(client: Client, mesh: Mesh, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train ``cfg.steps`` steps on ``mesh``; every step's record (rank 0's), in order."""
    run = client.call(build_run, mesh, cfg)
    steps = [client.call(train_step, mesh, run, step) for step in range(1, cfg.steps + 1)]
    return [future.result(0) for future in steps]
