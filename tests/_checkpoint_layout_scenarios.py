"""Checkpoints in every layout of the composition matrix: the project's GPT and a
HuggingFace Llama, with tied and untied embeddings and a vocabulary large enough that
each pipeline stage's ZeRO cuts a tied embedding into other ranges (the save of a tied
Llama at pp2 x dp2 ZeRO-1 failed so), trained on real batches (``_real_batch_scenarios``),
saved after a step and resumed in the next layout of the same world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import _real_batch_scenarios as rb

VOCAB = 2048  # embeddings (65536 elements) larger than half of a stage's parameters
STEPS, SAVED_AT = 3, 1
MODELS = ("gpt", "llama")


def build(name: str, tied: bool) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from pycomm.parallel.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=rb.SEQ, n_layer=2, n_head=4,
                             n_embd=32, tie_embeddings=tied))
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=rb.SEQ,
        tie_word_embeddings=tied, attn_implementation="sdpa"))


def _engine(layout: str, name: str, tied: bool) -> tuple[Any, Any]:
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = rb.LAYOUTS[layout]
    if tied:  # a tied layer is refused by tiles (tests/test_zero3_tiles.py): kept whole
        config = {k: v for k, v in config.items() if k != "max_unit_bytes"}
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    engine = parallelize(build(name, tied), mesh, ParallelConfig(
        max_grad_norm=rb.CLIP, weight_decay=rb.DECAY, optimizer_kwargs={"lr": rb.LR}, **config))
    return engine, mesh


def _steps(engine: Any, first: int, end: int) -> list[float]:
    out = []
    for step in range(first, end):
        b = rb.batch("ignored", step)
        out.append(engine.train_step(b.tokens, b.targets, **b.inputs()).loss)
    return out


def save_and_resume(saver: str, loader: str, root: str, models: tuple[str, ...] = MODELS
                    ) -> dict[tuple[str, bool], tuple[list[float], int, list[float]]]:
    """For each of ``models``, tied and untied: the uninterrupted run of ``saver`` (saving
    after step ``SAVED_AT``), the step the checkpoint says, and the steps after it resumed
    in ``loader``."""
    out = {}
    for name in models:
        for tied in (True, False):
            path = f"{root}/{name}-{'tied' if tied else 'untied'}"
            engine, mesh = _engine(saver, name, tied)
            whole = _steps(engine, 0, SAVED_AT)
            engine.save(path, {"step": SAVED_AT})
            whole += _steps(engine, SAVED_AT, STEPS)
            mesh.destroy()
            engine, mesh = _engine(loader, name, tied)
            start = engine.load(path)["step"]
            out[(name, tied)] = (whole, start, _steps(engine, start, STEPS))
            mesh.destroy()
    return out
