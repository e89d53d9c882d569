"""What each rank runs for tests/test_zero_offload.py: ZeRO-Offload (stages 1-2, the
optimizer state in a unit store, the masters in memory) against the same stage in
memory, on the project's GPT at dp=2 (fp32 and bf16, clipped), at tp=2 and pp=2; ZeRO-3
offload at tp=2 (fp32, bf16) and pp=2 (untied, and the head tied to the embedding
across the stages), clipped; and a checkpoint of an offloaded ZeRO-1
run resumed in memory."""

from __future__ import annotations

import os
from typing import Any

import torch
from _offload_scenarios import CLIP, batch, build, lr_lambda

STEPS = 10
CASES = {  # name -> (mesh sizes, ParallelConfig settings)
    "zero1": ({"dp": 2}, {"zero": 1}),
    "zero2": ({"dp": 2}, {"zero": 2}),
    "zero2-bf16": ({"dp": 2}, {"zero": 2, "precision": "bf16"}),
    "zero1-tp2": ({"tp": 2}, {"zero": 1}),
    "zero1-pp2": ({"pp": 2}, {"zero": 1, "microbatches": 2}),
    # ZeRO-3 offload (whole units in the store) with model parallelism
    "zero3-tp2": ({"tp": 2}, {"zero": 3}),
    "zero3-tp2-bf16": ({"tp": 2}, {"zero": 3, "precision": "bf16"}),
    # built on the meta device (each unit materialized as it is sharded, as --init meta)
    "zero3-tp2-meta": ({"tp": 2}, {"zero": 3, "meta": True}),
    "zero3-pp2": ({"pp": 2}, {"zero": 3, "microbatches": 2}),
    # the head tied to the embedding, on the other stage: the copies' gradients summed
    # in their records before the units step
    "zero3-pp2-tied": ({"pp": 2}, {"zero": 3, "microbatches": 2, "tied": True}),
    # unclipped, one micro-batch: the tie alone defers the units' steps
    "zero3-pp2-tied-unclipped": ({"pp": 2}, {"zero": 3, "microbatches": 1, "tied": True,
                                             "max_grad_norm": None}),
}


def _engine(sizes: dict[str, int], settings: dict[str, Any], offload: str,
            directory: str) -> Any:
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(**{"pp": 1, "dp": 1, "tp": 1, **sizes})
    settings = dict(settings)
    with torch.device("meta" if settings.pop("meta", False) else "cpu"):
        model = build("gpt")
    if settings.pop("tied", False):
        model.lm_head.weight = model.embed.wte.weight
    return parallelize(model, mesh, ParallelConfig(**{
        "max_grad_norm": CLIP, "weight_decay": 0.1, "lr_lambda": lr_lambda,
        "optimizer_kwargs": {"lr": 3e-3}, "offload": offload, "offload_dir": directory,
        **settings}))


def _finish(engine: Any) -> dict[str, Any]:
    """Each rank's parameters (stage 3: gathered whole), how many records stepped and
    how many there are (None in memory), the losses and gradient norms."""
    zero3 = engine.stage.__dict__.get("zero3")
    if zero3 is not None:
        out = zero3.full_state_dict()
    else:
        out = {n: p.detach().clone() for n, p in engine.stage.named_parameters()}
    state = engine.dp.state.store  # the unit store, None in memory
    engine.mesh.destroy()
    return {"params": out, "steps": None if state is None else state.stats["steps"],
            "buckets": None if state is None else len(state.units)}


def run_all(root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, (sizes, settings) in CASES.items():
        for offload in ("none", "disk"):
            engine = _engine(sizes, settings, offload, os.path.join(root, f"{name}-{offload}"))
            curve = [engine.train_step(*batch(step)) for step in range(STEPS)]
            out[(name, offload)] = _finish(engine)
            out[(name, offload)]["curve"] = [(r.loss, r.grad_norm) for r in curve]
    # saved offloaded after 3 steps, resumed in memory for the rest
    sizes, settings = CASES["zero1"]
    engine = _engine(sizes, settings, "disk", os.path.join(root, "ck-a"))
    for step in range(3):
        engine.train_step(*batch(step))
    engine.save(os.path.join(root, "ckpt"), {})
    engine.mesh.destroy()
    engine = _engine(sizes, settings, "none", "")
    engine.load(os.path.join(root, "ckpt"))
    for step in range(3, STEPS):
        engine.train_step(*batch(step))
    out["resumed"] = _finish(engine)
    return out


def refused_saves(root: str) -> list[str]:
    """The messages of ZeroOptimizer.state_dict and save_sharded on a ZeRO-Offload run."""
    from pycomm.parallel.zero.sharded_checkpoint import save_sharded

    engine = _engine({"dp": 2}, {"zero": 1}, "disk", os.path.join(root, "o"))
    engine.train_step(*batch(0))
    messages = []
    for call in (lambda: engine.optimizer.state_dict(),
                 lambda: save_sharded(os.path.join(root, "c"), engine.stage, engine.optimizer)):
        try:
            call()
            messages.append("")
        except RuntimeError as err:
            messages.append(str(err))
    engine.mesh.destroy()
    return messages
