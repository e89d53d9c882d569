"""What each rank runs for tests/test_offload_checkpoint.py: the tiny Llama of
tests/_offload_scenarios.py in bf16 with clipping, checkpointed after 3 of 6 steps
offloaded or in memory and resumed either way (and at dp=1), and exported to a
HuggingFace folder from an offloaded run."""

from __future__ import annotations

import os
from typing import Any

import torch
from _offload_scenarios import CLIP, batch, build, lr_lambda

STEPS, SAVE_AT = 6, 3
RESUMES = (("disk", "none"), ("none", "disk"), ("disk", "disk"), ("cpu", "disk"))


def _engine(offload: str, directory: str, dp: int = 2, precision: str = "bf16") -> Any:
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(pp=1, dp=dp, tp=1)
    return parallelize(build("llama"), mesh, ParallelConfig(
        zero=3, max_grad_norm=CLIP, weight_decay=0.1, lr_lambda=lr_lambda,
        optimizer_kwargs={"lr": 3e-3}, offload=offload, offload_dir=directory,
        precision=precision))


def _params(engine: Any) -> dict[str, torch.Tensor]:
    params = engine.stage.__dict__["zero3"].full_state_dict()
    engine.mesh.destroy()
    return params


def _train(engine: Any, steps: range) -> Any:
    for step in steps:
        engine.train_step(*batch(step))
    return engine


def _resumed(root: str, first: str, second: str, dp: int = 2) -> dict[str, torch.Tensor]:
    """``SAVE_AT`` steps (``first``), saved; loaded at ``dp`` (``second``), the rest."""
    checkpoint = os.path.join(root, f"ckpt-{first}")
    if not os.path.isdir(checkpoint):  # one checkpoint per first half, shared
        engine = _train(_engine(first, os.path.join(root, f"a-{first}")), range(SAVE_AT))
        engine.save(checkpoint, {"step": SAVE_AT})
        engine.mesh.destroy()
    engine = _engine(second, os.path.join(root, f"b-{first}-{second}-{dp}"), dp=dp)
    assert engine.load(checkpoint) == {"step": SAVE_AT}
    return _params(_train(engine, range(SAVE_AT, STEPS)))


def run_all(root: str) -> dict[Any, Any]:
    import torch.distributed as dist

    out: dict[Any, Any] = {"whole": _params(_train(_engine("none", ""), range(STEPS)))}
    for first, second in RESUMES:
        out[(first, second)] = _resumed(root, first, second)
        dist.barrier()
    out["files"] = len(os.listdir(os.path.join(root, "ckpt-disk")))
    return out


def resumed_alone(root: str) -> dict[Any, Any]:
    """On one rank: the offloaded dp=2 checkpoint of :func:`run_all` resumed at dp=1,
    offloaded and in memory."""
    return {second: _resumed(root, "disk", second, dp=1) for second in ("none", "disk")}


def exported(root: str) -> dict[str, Any]:
    """An fp32 offloaded run's HF export: its logits beside the engine's."""
    import torch.distributed as dist

    from pycomm.parallel.compose.export import save_pretrained

    engine = _train(_engine("disk", os.path.join(root, "x"), precision="fp32"), range(2))
    tokens = batch(9)[0]
    logits = engine.logits(tokens)
    checkpoint = os.path.join(root, "export-ckpt")
    engine.save(checkpoint, {})
    out = os.path.join(root, "hf")
    if dist.get_rank() == 0:
        import transformers

        config = transformers.LlamaConfig(**__import__("_offload_scenarios").LLAMA)
        save_pretrained(checkpoint, config, out, shard_bytes=100_000)  # several files
    dist.barrier()
    engine.mesh.destroy()
    return {"logits": logits, "tokens": tokens, "folder": out, "files": sorted(os.listdir(out))}
