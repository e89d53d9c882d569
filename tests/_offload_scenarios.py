"""What each rank runs for tests/test_offload.py: the project's GPT and a tiny HuggingFace
Llama trained 10 steps by the composed engine at dp=2, ZeRO-3 in memory, offloaded to
files and offloaded to host memory; the parameters, losses and offload counters returned."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pycomm.parallel.models import GPT, GPTConfig

STEPS = 10
CLIP = 0.3  # below the norms of these runs (0.5 to 3): every step is clipped
BATCH, SEQ, VOCAB = 4, 16, 256
# the trainer's default GPT (4 blocks of width 128), on shorter sequences
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128,
                    dropout=0.0)
OTHER_OPTIMIZERS = {"sgd-momentum": (torch.optim.SGD, {"lr": 3e-2, "momentum": 0.9}),
                    "adagrad": (torch.optim.Adagrad, {"lr": 3e-2}),
                    "adam-amsgrad": (torch.optim.Adam, {"lr": 3e-3, "amsgrad": True})}
FP16_OVERFLOWING_SCALE = 2.0**40  # halved per overflow: the first steps are skipped
SPLIT_NUMEL = 10_000  # the Llama's embedding and head (256 x 64) become units
LIVE_BUDGET_BYTES = 200_000  # a block gathered in bf16 is 2 x 49,152 bytes
TILE_BYTES = 64 * 64 * 4  # the Llama's embedding and head as 4 tiles of 64 rows each
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attn_implementation="sdpa")


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def build(name: str, n_layer: int = 4) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(**{**GPT_CFG.__dict__, "n_layer": n_layer}))
    import transformers

    config = transformers.LlamaConfig(**LLAMA)
    return transformers.LlamaForCausalLM(config)


def train(name: str, offload: str, directory: str, steps: int = STEPS,
          n_layer: int = 4, prefetch: int = 2, recompute: bool = False,
          clip: float | None = None, microbatches: int = 1,
          **config: Any) -> dict[str, Any]:
    """``steps`` steps of ``name`` at dp=2, ZeRO-3 (``offload`` none, cpu or disk),
    clipping the gradient norm to ``clip``, over ``microbatches`` backwards a step
    (``config``: more of ``ParallelConfig``)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    model = build(name, n_layer)
    mesh = ParallelMesh(pp=1, dp=2, tp=1)
    settings: dict[str, Any] = dict(
        zero=3, max_grad_norm=clip, weight_decay=0.1, lr_lambda=lr_lambda,
        optimizer_kwargs={"lr": 3e-3}, offload=offload, offload_dir=directory,
        offload_prefetch=prefetch, recompute=recompute, microbatches=microbatches)
    engine = parallelize(model, mesh, ParallelConfig(**{**settings, **config}))
    curve, skipped = [], 0
    for step in range(steps):
        r = engine.train_step(*batch(step))
        curve.append((r.loss, r.grad_norm))
        skipped += r.skipped
    zero3 = engine.stage.__dict__["zero3"]
    params = zero3.full_state_dict()
    offloaded = zero3.offload
    stats = offloaded.io_stats() if offloaded is not None else {}
    files = sorted(os.listdir(directory)) if offload == "disk" else []
    mesh.destroy()
    return {"params": params, "curve": curve, "stats": stats, "units": len(zero3.units),
            "files": files, "skipped": skipped, "pool": zero3.pool.stats(),
            "gathers": dict(zero3.stats)}


def run_all(root: str) -> dict[Any, Any]:
    """Every case on this rank, each in its own folder under ``root``."""
    out: dict[Any, Any] = {}
    for name in ("gpt", "llama"):
        for offload in ("none", "disk", "cpu"):
            directory = os.path.join(root, f"{name}-{offload}")
            out[(name, offload)] = train(name, offload, directory)
    for offload in ("none", "disk"):  # a block's forward runs again inside backward
        out[("recompute", offload)] = train("gpt", offload, os.path.join(root, "rc"), steps=4,
                                            recompute=True)
    for name in ("gpt", "llama"):  # clipped below every step's norm: the units step after it
        for offload in ("none", "disk"):
            out[(name, f"clip {offload}")] = train(name, offload, os.path.join(
                root, f"clip-{name}-{offload}"), clip=CLIP)
    for offload in ("none", "disk"):  # 2 micro-batches summed in the records, then clipped
        out[("gpt", f"accumulate {offload}")] = train(
            "gpt", offload, os.path.join(root, f"acc-{offload}"), clip=CLIP, microbatches=2)
    for name in ("gpt", "llama"):  # bf16 compute, fp32 masters in the records
        for offload in ("none", "disk"):
            out[(name, f"bf16 {offload}")] = train(name, offload, os.path.join(
                root, f"bf16-{name}-{offload}"), precision="bf16")
    for offload in ("none", "disk"):  # tiles: bf16, clipped, the loss in the head's chunks
        out[("llama", f"tiles {offload}")] = train(
            "llama", offload, os.path.join(root, f"tiles-{offload}"), clip=CLIP,
            precision="bf16", max_unit_bytes=TILE_BYTES)
    for offload in ("none", "disk"):  # fp16: the first steps overflow and are skipped
        out[("gpt", f"fp16 {offload}")] = train(
            "gpt", offload, os.path.join(root, f"fp16-{offload}"), clip=CLIP, precision="fp16",
            loss_scale=FP16_OVERFLOWING_SCALE)
    out["budget"] = budget_run(os.path.join(root, "budget"))
    for name, (optimizer, options) in OTHER_OPTIMIZERS.items():  # their state in the records
        for offload in ("none", "disk"):
            out[(name, offload)] = train("gpt", offload, os.path.join(root, f"{name}-{offload}"),
                                         steps=4, clip=CLIP, optimizer=optimizer,
                                         optimizer_kwargs=options)
    # twice the depth of ("gpt", "disk"): what is held in memory must not grow with it
    out["deep"] = train("gpt", "disk", os.path.join(root, "deep"), steps=2, n_layer=8)
    return out


def budget_run(directory: str) -> dict[str, Any]:
    """The Llama offloaded in bf16 under a live budget of about two of its blocks, its
    embedding and head (over ``OWN_UNIT_NUMEL`` here) units of their own."""
    import pycomm.parallel.zero.plan_units as units

    units.OWN_UNIT_NUMEL = SPLIT_NUMEL
    try:
        return train("llama", "disk", directory, precision="bf16",
                     max_live_bytes=LIVE_BUDGET_BYTES)
    finally:
        units.OWN_UNIT_NUMEL = 1 << 20


def refused(root: str) -> list[str]:
    """The messages of every combination offload refuses (on one rank's mesh of 2)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    cases = [dict(zero=0), dict(optimizer=torch.optim.LBFGS), dict(offload_dir="")]
    messages = []
    for case in cases:
        mesh = ParallelMesh(pp=1, dp=2, tp=1)
        model = build("gpt", 2)
        config = {"zero": 3, "max_grad_norm": None, "offload": "disk", "offload_dir": root,
                  **case}
        try:
            parallelize(model, mesh, ParallelConfig(**config))
            messages.append("")
        except ValueError as err:
            messages.append(str(err))
        mesh.destroy()
    return messages
