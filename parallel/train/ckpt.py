"""The trainer's checkpoints: ``<ckpt_dir>/step_<N>`` folders written by ``engine.save``
(each rank its part, keyed by mesh position), and resuming from the newest one in
whatever layout this run has (``engine.load``).

``extra`` carries the step, the seed and the model's shape: with the step, the data
position follows (a batch depends only on ``(seed, step)``) and so does dropout (seeded
per step), so the steps after a resume are the ones the uninterrupted run takes. It also
carries the learning-rate schedule's settings: a resumed run follows its *own* (a longer
``--steps``, another ``--lr`` take effect from the resumed step, as the checkpoint's
engine-level state holds only the step), and says in one line what changed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..job.config import TrainConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")  # "step_000010.partial" (an unfinished save) is not
_MODEL_KEYS = ("model", "n_layer", "n_head", "n_embd", "block_size", "tie_embeddings")
_EXPERT_KEYS = ("moe_experts", "moe_top_k", "moe_aux_coef")  # recorded where there are experts
_SCHEDULE_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio")


def step_dir(cfg: TrainConfig, step: int) -> Path:
    return Path(cfg.ckpt_dir) / f"step_{step:06d}"


def latest(ckpt_dir: str) -> Path | None:
    """The complete checkpoint of the highest step in ``ckpt_dir``, if any."""
    root = Path(ckpt_dir)
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir()
             and (m := _STEP_DIR.match(p.name))] if root.is_dir() else []
    return max(found)[1] if found else None


def extra_of(cfg: TrainConfig, step: int) -> dict[str, Any]:
    return {"step": step, "seed": cfg.seed, "layout": [cfg.dp, cfg.tp, cfg.pp],
            "model": _model_of(cfg),
            "schedule": {k: getattr(cfg, k) for k in _SCHEDULE_KEYS}}


def _model_of(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run's model must share (a dense model's as they always were)."""
    keys = _MODEL_KEYS + (_EXPERT_KEYS if cfg.moe_experts else ())
    return {k: getattr(cfg, k) for k in keys}


def schedule_changes(saved: dict[str, Any], cfg: TrainConfig, step: int) -> str:
    """One line naming the schedule settings this run changes, or ""."""
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in _SCHEDULE_KEYS
               if k in saved and saved[k] != getattr(cfg, k)]
    if not changed:
        return ""
    return (f"resume: the learning-rate schedule continues from step {step} with this run's "
            f"settings ({', '.join(changed)})")


def save(engine: Any, cfg: TrainConfig, step: int) -> Path:
    """Checkpoint ``step`` (collective over the world)."""
    path = step_dir(cfg, step)
    engine.save(path, extra_of(cfg, step))
    return path


def resume(engine: Any, cfg: TrainConfig) -> tuple[int, Path, str]:
    """Load the newest checkpoint of ``cfg.ckpt_dir``; returns its step, its path and the
    line naming the schedule settings that changed (collective). Raises ValueError when
    there is none, or it was trained with another model or seed (the steps after it
    would not continue that run)."""
    path = latest(cfg.ckpt_dir)
    if path is None:
        raise ValueError(f"train: --resume, but {cfg.ckpt_dir} holds no complete "
                         "checkpoint (step_<N> folder)")
    extra = engine.load(path)
    model = _model_of(cfg)
    if extra.get("model") != model or extra.get("seed") != cfg.seed:
        raise ValueError(f"train: {path} was trained with model {extra.get('model')} and "
                         f"seed {extra.get('seed')}; this run has {model} and seed "
                         f"{cfg.seed}")
    step = int(extra["step"])
    return step, path, schedule_changes(extra.get("schedule", {}), cfg, step)


def export_hf(engine: Any, cfg: TrainConfig) -> Path:
    """The trained model as a HuggingFace folder in ``cfg.export_hf`` (collective: a
    sharded checkpoint first, then rank 0 assembles it)."""
    import torch.distributed as dist

    from ..compose.export import save_pretrained
    from ..job.models import hf_config

    out = Path(cfg.export_hf)
    staging = out.with_name(out.name + ".checkpoint")
    engine.save(staging, {"step": cfg.steps})
    if dist.get_rank() == 0:
        save_pretrained(staging, hf_config(cfg), out)
    dist.barrier()
    return out
