"""What each rank runs for tests/test_zero_offload.py: ZeRO-Offload (stages 1-2, the
optimizer state in a unit store, the masters in memory) against the same stage in
memory, on the project's GPT at dp=2 (fp32 and bf16, clipped), at tp=2 and pp=2, and a
checkpoint of an offloaded ZeRO-1 run resumed in memory."""

from __future__ import annotations

import os
from typing import Any

import torch
from _offload_scenarios import CLIP, batch, build, lr_lambda

STEPS = 6
CASES = {  # name -> (mesh sizes, ParallelConfig settings)
    "zero1": ({"dp": 2}, {"zero": 1}),
    "zero2": ({"dp": 2}, {"zero": 2}),
    "zero2-bf16": ({"dp": 2}, {"zero": 2, "precision": "bf16"}),
    "zero1-tp2": ({"tp": 2}, {"zero": 1}),
    "zero1-pp2": ({"pp": 2}, {"zero": 1, "microbatches": 2}),
}


def _engine(sizes: dict[str, int], settings: dict[str, Any], offload: str,
            directory: str) -> Any:
    from parallel.compose.mesh import ParallelMesh
    from parallel.compose.parallelize import ParallelConfig, parallelize

    mesh = ParallelMesh(**{"pp": 1, "dp": 1, "tp": 1, **sizes})
    return parallelize(build("gpt"), mesh, ParallelConfig(
        max_grad_norm=CLIP, weight_decay=0.1, lr_lambda=lr_lambda,
        optimizer_kwargs={"lr": 3e-3}, offload=offload, offload_dir=directory, **settings))


def _finish(engine: Any) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in engine.stage.named_parameters()}
    state = engine.optimizer.state_offload
    engine.mesh.destroy()
    return {"params": out, "steps": None if state is None else state.stats["steps"],
            "buckets": None if state is None else len(state.units)}


def run_all(root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, (sizes, settings) in CASES.items():
        for offload in ("none", "disk"):
            engine = _engine(sizes, settings, offload, os.path.join(root, f"{name}-{offload}"))
            for step in range(STEPS):
                engine.train_step(*batch(step))
            out[(name, offload)] = _finish(engine)
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
    from parallel.zero.checkpoint import save_sharded

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
