"""The reference GPT as a sequence of layers a pipeline can cut: the embedding, each
block, and the head (final norm and LM head), with the names its parameters have in the
unsplit model, so checkpoints and reports speak of one model whatever the layout.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.models import GPT


class EmbeddingLayer(nn.Module):
    """Tokens in, the first block's input out."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.embed = gpt.embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.embed.wpe.num_embeddings:
            raise ValueError(f"GPT: sequence length {tokens.shape[1]} exceeds block_size "
                             f"{self.embed.wpe.num_embeddings}")
        return self.embed(tokens)


class HeadLayer(nn.Module):
    """The final LayerNorm and the LM head: the last block's output in, logits out."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_layers(gpt: GPT) -> nn.Sequential:
    """``gpt`` as ``[embedding, block 0, ..., block n-1, head]`` (the same modules)."""
    return nn.Sequential(EmbeddingLayer(gpt), *gpt.blocks, HeadLayer(gpt))


def model_name(layer_index: int, name: str, n_blocks: int) -> str:
    """The name, in the unsplit GPT, of parameter ``name`` of layer ``layer_index``."""
    if layer_index == 0:
        return name  # "embed.wte.weight"
    if layer_index <= n_blocks:
        return f"blocks.{layer_index - 1}.{name}"
    return name  # "ln_f.weight", "lm_head.weight"


def stage_balance(n_blocks: int, stages: int) -> list[int]:
    """Layers per pipeline stage: blocks split as evenly as possible (earlier stages take
    the extra ones), the embedding on the first stage and the head on the last.

    Raises:
        ValueError: fewer blocks than stages.
    """
    if n_blocks < stages:
        raise ValueError(f"pipeline: {n_blocks} blocks cannot be split over {stages} stages "
                         "(each stage needs at least one block)")
    base, extra = divmod(n_blocks, stages)
    balance = [base + (1 if s < extra else 0) for s in range(stages)]
    balance[0] += 1
    balance[-1] += 1
    return balance
