"""Real batches against one process: three models (the project's GPT, HuggingFace Llama and
Qwen3 from configs) on batches shaped as real data is - prompts ignored (-100) in uneven
counts per row, right and left padding with an attention mask, documents packed into rows
with restarting position ids - trained a few steps in one layout of ``parallelize``, and by
one process computing ``F.cross_entropy(logits, targets, ignore_index=-100)`` over the
global batch with the same mask and positions. The losses and the pre-clip gradient norms
of every step are compared (``tests/test_real_batches.py``; ``tests/real_batch_table.py``
prints the table for more steps).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pycomm.parallel.train.batches import Batch

VOCAB, SEQ, ROWS = 64, 16, 4
IGNORE = -100
LR, CLIP, DECAY = 3e-3, 1.0, 0.1
MODELS = ("gpt", "llama", "qwen3")
CASES = ("ignored", "right_pad", "left_pad", "packed")
PAD = 0
TILE_BYTES = 16 * 32 * 4  # 16 rows of the embedding or head, in fp32


def build(name: str, dtype: str = "float32") -> nn.Module:
    """The model ``name`` in ``dtype`` (float32; float64 shows the layouts exact beyond
    fp32's rounding), from seed 0 (the same on every rank)."""
    return _build(name).to(getattr(torch, dtype))


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from pycomm.parallel.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                  pad_token_id=PAD, tie_word_embeddings=False, attn_implementation="sdpa")
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    raise ValueError(f"no model {name!r}")


def _lengths(gen: torch.Generator, low: int) -> list[int]:
    return [int(v) for v in torch.randint(low, SEQ + 1, (ROWS,), generator=gen)]


def batch(case: str, step: int) -> Batch:
    """The global batch of ``step`` for ``case`` (from ``step`` alone)."""
    gen = torch.Generator().manual_seed(100 * CASES.index(case) + step)
    data = torch.randint(1, VOCAB, (ROWS, SEQ + 1), generator=gen)
    tokens, targets = data[:, :-1].clone(), data[:, 1:].clone()
    if case == "ignored":  # an SFT prompt of uneven length per row, one row all prompt
        for row, prompt in enumerate(_lengths(gen, 0)):
            targets[row, :prompt] = IGNORE
        targets[step % ROWS, :] = IGNORE
        return Batch(tokens, targets)
    if case in ("right_pad", "left_pad"):
        mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
        for row, length in enumerate(_lengths(gen, 3)):
            real = slice(0, length) if case == "right_pad" else slice(SEQ - length, SEQ)
            mask[row, real] = 1
            targets[row, real.stop - 1] = IGNORE  # the last real token predicts nothing
            targets[row, : real.start] = IGNORE
            targets[row, real.stop :] = IGNORE
        tokens = tokens.masked_fill(mask == 0, PAD)
        return Batch(tokens, targets, attention_mask=mask)
    if case == "packed":  # documents packed into rows, positions restarting at each
        positions = torch.zeros(ROWS, SEQ, dtype=torch.long)
        for row in range(ROWS):
            cuts = sorted(set(torch.randint(1, SEQ, (3,), generator=gen).tolist()))
            starts = [0, *cuts]
            for a, b in zip(starts, [*cuts, SEQ], strict=True):
                positions[row, a:b] = torch.arange(b - a)
                targets[row, b - 1] = IGNORE  # no prediction across a document boundary
        return Batch(tokens, targets, position_ids=positions)
    raise ValueError(f"no case {case!r}")


def _logits(model: nn.Module, b: Batch) -> torch.Tensor:
    extra = {"use_cache": False} if hasattr(model, "config") else {}
    out = model(b.tokens, **b.inputs(), **extra)
    return out.logits if hasattr(out, "logits") else out


def one_process(name: str, case: str, steps: int, chunks: int = 1, dtype: str = "float32"
                ) -> list[tuple[float, float]]:
    """The curve every layout must reproduce: the loss and pre-clip gradient norm.
    ``chunks`` > 1 accumulates the gradient over that many chunks of rows, each loss
    summed over the batch's count (the same loss in another order of summation: what
    the fp32 rounding alone makes of a curve)."""
    from pycomm.parallel.checkpointing.optim_groups import param_groups

    model = build(name, dtype)
    opt = torch.optim.AdamW(param_groups(list(model.parameters()), DECAY), lr=LR)
    out = []
    for step in range(steps):
        b = batch(case, step)
        opt.zero_grad()
        count = max(int((b.targets != IGNORE).sum()), 1)
        total = 0.0
        for rows in torch.arange(ROWS).chunk(chunks):
            part = Batch(b.tokens[rows], b.targets[rows],
                         **{k: v[rows] for k, v in b.inputs().items()})
            logits = _logits(model, part)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), part.targets.reshape(-1),
                                   ignore_index=IGNORE, reduction="sum") / count
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        out.append((total, norm.item()))
    return out


# name -> (dp, tp, pp, config): the layouts of the composition matrix
LAYOUTS: dict[str, tuple[int, int, int, dict[str, Any]]] = {
    "dp2": (2, 1, 1, {}),
    "dp2 zero3": (2, 1, 1, {"zero": 3}),
    "dp2 M=2": (2, 1, 1, {"microbatches": 2}),
    "tp2": (1, 2, 1, {}),
    "tp2+SP": (1, 2, 1, {"sequence_parallel": True}),
    "pp2 M=2": (1, 1, 2, {"microbatches": 2}),
    "dp2 x tp2": (2, 2, 1, {"zero": 2}),
    "pp2 x dp2": (2, 1, 2, {"microbatches": 2, "zero": 1}),
    "2x2x2": (2, 2, 2, {"microbatches": 2, "zero": 1, "sequence_parallel": True}),
    # offload: ZeRO-3's units in files (over dp; and over tp and pp, each rank its own
    # units); ZeRO-Offload (the optimizer state) under a pipeline
    "dp2 zero3 offload": (2, 1, 1, {"zero": 3, "offload": "disk",
                                    "offload_dir": tempfile.gettempdir()}),
    "pp2 x tp2 zero3 offload": (1, 2, 2, {"microbatches": 2, "zero": 3, "offload": "disk",
                                          "offload_dir": tempfile.gettempdir()}),
    "pp2 x dp2 zero1 offload": (2, 1, 2, {"microbatches": 2, "zero": 1, "offload": "disk",
                                          "offload_dir": tempfile.gettempdir()}),
    # ZeRO-3 tiles: the embedding and head (64 x 32) split into 4 units of 16 rows, the
    # loss taken in the head's vocabulary chunks; in memory, and offloaded under a pipeline
    "dp2 zero3 tiles": (2, 1, 1, {"zero": 3, "max_unit_bytes": TILE_BYTES}),
    "pp2 x dp2 zero3 tiles offload": (2, 1, 2, {"microbatches": 2, "zero": 3,
                                                "max_unit_bytes": TILE_BYTES,
                                                "offload": "disk",
                                                "offload_dir": tempfile.gettempdir()}),
}


def world_of(layout: str) -> int:
    dp, tp, pp, _ = LAYOUTS[layout]
    return dp * tp * pp


def layout_curves(layout: str, models: tuple[str, ...], cases: tuple[str, ...],
                  steps: int, dtype: str = "float32"
                  ) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """On the ranks of a pool of this layout's world: every model and case trained
    ``steps`` steps; the curve of each, keyed (model, case)."""
    return layout_pairs(layout, [(m, c) for m in models for c in cases], steps, dtype)


def layout_pairs(layout: str, pairs: list[tuple[str, str]], steps: int,
                 dtype: str = "float32") -> dict[tuple[str, str], list[tuple[float, float]]]:
    """The same for the (model, case) ``pairs``."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = LAYOUTS[layout]
    out = {}
    for name, case in pairs:
        mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
        engine = parallelize(build(name, dtype), mesh, ParallelConfig(
            max_grad_norm=CLIP, weight_decay=DECAY, optimizer_kwargs={"lr": LR}, **config))
        curve = []
        for step in range(steps):
            b = batch(case, step)
            r = engine.train_step(b.tokens, b.targets, **b.inputs())
            curve.append((r.loss, r.grad_norm))
        out[(name, case)] = curve
        mesh.destroy()
    return out


def worst_relative(got: list[tuple[float, float]], want: list[tuple[float, float]]
                   ) -> tuple[float, float]:
    """The largest relative difference of the loss and of the gradient norm."""
    loss = max(abs(g[0] / w[0] - 1) for g, w in zip(got, want, strict=True))
    norm = max(abs(g[1] / w[1] - 1) for g, w in zip(got, want, strict=True))
    return loss, norm


def bad_targets_refused(layout: str) -> list[str]:
    """The messages of steps whose targets the loss cannot take (a class past the
    vocabulary, a negative one that is not ignore_index, float targets), then the loss
    of a good step in the same engine (the refusals leave it usable)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = LAYOUTS[layout]
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    engine = parallelize(build("gpt"), mesh, ParallelConfig(**config))
    b = batch("ignored", 0)
    past, negative = b.targets.clone(), b.targets.clone()
    past[1, 3], negative[2, 5] = VOCAB, -5
    out = []
    for targets in (past, negative, b.targets.float()):
        try:
            engine.train_step(b.tokens, targets)
            out.append("no error")
        except ValueError as err:
            out.append(str(err))
    out.append(f"{engine.train_step(b.tokens, b.targets).loss:.3f}")
    mesh.destroy()
    return out
