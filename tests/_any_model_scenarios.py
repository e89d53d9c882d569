"""Models that are not causal LMs, through ``parallelize`` at data parallelism and ZeRO (which
need no plan): a CNN with BatchNorm (synchronised over the replicas), HuggingFace's
``BertForSequenceClassification`` on padded batches and ``ViTForImageClassification``,
each against one process built from the same weights (``tests/test_any_model.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROWS, STEPS, LR, CLIP = 4, 3, 1e-2, 1.0
CNN_ROWS = 16


def optimizer(kind: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """AdamW without weight decay, the engine's default (torch's AdamW decays by 0.01
    unless told)."""
    return torch.optim.AdamW, {"lr": LR, "weight_decay": 0.0}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        # No bias before a BatchNorm (it would cancel it): its gradient would be rounding
        # noise, which Adam turns into steps of the full rate and any sign.
        return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Flatten(), nn.Linear(8 * 6 * 6, 16, bias=False),
                             nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 10))
    import transformers

    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, max_position_embeddings=32))
    if kind == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    raise ValueError(kind)


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, labels, model inputs) of ``step``; BERT's rows padded to uneven lengths."""
    gen = torch.Generator().manual_seed(step)
    if kind == "cnn":
        return (torch.randn(CNN_ROWS, 3, 8, 8, generator=gen) * 2 + 1,
                torch.randint(0, 10, (CNN_ROWS,), generator=gen), {})
    if kind == "bert":
        tokens = torch.randint(1, 128, (ROWS, 12), generator=gen)
        mask = torch.ones(ROWS, 12, dtype=torch.long)
        for row, length in enumerate((12, 5, 9, 3)):
            mask[row, length:] = 0
        return (tokens.masked_fill(mask == 0, 0), torch.randint(0, 3, (ROWS,), generator=gen),
                {"attention_mask": mask})
    return (torch.randn(ROWS, 3, 16, 16, generator=gen),
            torch.randint(0, 10, (ROWS,), generator=gen), {})


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def one_process(kind: str) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The curve (loss, pre-clip norm) and the final buffers (running statistics)."""
    model = build(kind).train()
    cls, kwargs = optimizer(kind)
    opt = cls(model.parameters(), **kwargs)
    curve = []
    for step in range(STEPS):
        x, y, extra = batch(kind, step)
        opt.zero_grad()
        loss = F.cross_entropy(_logits(model(x, **extra)), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        curve.append((loss.item(), norm.item()))
    return curve, {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def layout(kind: str, zero: int, config: dict[str, Any], shape: dict[str, int] | None = None
           ) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The same on a mesh of ``shape`` (default dp=2; this pool's world), with ZeRO stage
    ``zero``."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(**(shape or {"dp": 2}))
    model = build(kind)
    cls, kwargs = optimizer(kind)
    engine = parallelize(model, mesh, ParallelConfig(
        zero=zero, max_grad_norm=CLIP, optimizer=cls, optimizer_kwargs=kwargs, **config))
    curve = []
    for step in range(STEPS):
        x, y, extra = batch(kind, step)
        r = engine.train_step(x, y, **extra)
        curve.append((r.loss, r.grad_norm))
    buffers = {k: v.clone() for k, v in model.state_dict().items()
               if "running" in k and v.device.type != "meta"}  # (this stage's)
    mesh.destroy()
    return curve, buffers


def refusal(kind: str, mesh_shape: dict[str, int], config: dict[str, Any]) -> str:
    """The error ``parallelize`` raises for this layout, or "" if it builds."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(**mesh_shape)
    try:
        parallelize(build(kind), mesh, ParallelConfig(**config))
    except ValueError as err:
        return str(err)
    finally:
        mesh.destroy()
    return ""
