"""Pretrained HuggingFace weights into the sharded engine (``tests/test_pretrained.py``): a
Llama trained a few steps and written with ``save_pretrained`` (tied and untied), then
built on the meta device in a layout, each rank reading its pieces of the safetensors:
the engine's logits equal the saved model's, and a rank reads only what it holds."""

from __future__ import annotations

from typing import Any

import torch

from tests import _real_batch_scenarios as rb


def llama(tied: bool, device: str = "cpu") -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=rb.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=rb.SEQ,
        tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def save(tied: bool, directory: str) -> torch.Tensor:
    """Train a few steps, ``save_pretrained``; returns the saved model's logits."""
    model = llama(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        b = rb.batch("ignored", step)
        opt.zero_grad()
        out = model(b.tokens).logits
        torch.nn.functional.cross_entropy(out.reshape(-1, rb.VOCAB), b.targets.reshape(-1),
                                          ignore_index=rb.IGNORE).backward()
        opt.step()
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(rb.batch("packed", 9).tokens).logits


def load(layout: str, tied: bool, directory: str) -> tuple[torch.Tensor, int, int]:
    """The engine's logits after ``load_pretrained``, the elements this rank read, and
    the model's parameter count."""
    from pycomm.parallel.compose.config import ParallelConfig
    from pycomm.parallel.compose.parallelize import parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = rb.LAYOUTS[layout]
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    model = llama(tied, device="meta")
    total = sum(p.numel() for p in model.parameters())
    engine = parallelize(model, mesh, ParallelConfig(**config))
    read = engine.load_pretrained(directory)
    logits = engine.logits(rb.batch("packed", 9).tokens)
    mesh.destroy()
    return logits, read, total
