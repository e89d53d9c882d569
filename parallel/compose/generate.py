"""Generation with the parallel engine, in every layout: each new token from the whole
model's logits at the last position (:meth:`ParallelModel.logits`, computed by every
stage, TP rank and ZeRO shard together and given to every rank), so every rank picks the
same token, greedily or by sampling from a generator seeded alike everywhere.

Each step runs the whole sequence again (no KV cache: a pipeline stage would have to keep
its layers' keys and values per request); the tokens are those of the one-process model.
Left-padded batches (HuggingFace's convention for generating a batch) give their
``attention_mask``; positions then count real tokens only, as ``generate`` does. With
sequence parallelism the sequence is padded on the left to a multiple of TP, masked out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..precision import widened


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the last position's logits.

    Args:
        do_sample: draw from the softmax (else the most likely token).
        temperature: divides the logits before the softmax.
        top_k: draw among the ``top_k`` most likely tokens only (None: all).
        seed: seeds the draws (the same on every rank, so every rank draws alike).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def check(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"generate: temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"generate: top_k must be >= 1, got {self.top_k}")


def next_tokens(logits: torch.Tensor, sampling: Sampling,
                generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row from its last position's logits ``(batch, vocab)``."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    scaled = widened(logits) / sampling.temperature
    if sampling.top_k is not None:
        kth = scaled.topk(min(sampling.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (``generate``'s for left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def _left_pad(tokens: torch.Tensor, mask: torch.Tensor, multiple: int, pad: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    extra = -tokens.shape[1] % multiple
    if not extra:
        return tokens, mask
    rows = tokens.shape[0]
    return (torch.cat([tokens.new_full((rows, extra), pad), tokens], dim=1),
            torch.cat([mask.new_zeros((rows, extra)), mask], dim=1))


def generate(engine: Any, tokens: torch.Tensor, max_new_tokens: int,
             attention_mask: torch.Tensor | None = None, sampling: Sampling | None = None,
             eos_token_id: int | None = None, pad_token_id: int | None = None) -> torch.Tensor:
    """``tokens`` followed by up to ``max_new_tokens`` generated ones, on every rank (see
    the module docstring). A row that emitted ``eos_token_id`` continues with
    ``pad_token_id`` (default: the EOS), and generation stops once every row has.

    Raises:
        ValueError: a bad setting, or sequence parallelism with a plan that takes no
            attention mask (the sequence could not be padded to a multiple of TP).
    """
    sampling = sampling or Sampling()
    sampling.check()
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    takes = engine.plan.inputs
    if attention_mask is not None and "attention_mask" not in takes:
        raise ValueError(f"generate: the plan for {engine.plan.name} takes no attention_mask")
    tp = engine.mesh.size("tp") if engine.config.sequence_parallel else 1
    if tp > 1 and "attention_mask" not in takes:
        raise ValueError(f"generate: sequence parallelism splits the sequence over tp={tp}, "
                         f"and the plan for {engine.plan.name} takes no attention_mask to "
                         "pad it to a multiple of tp with")
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.do_sample else None
    mask = attention_mask if attention_mask is not None else (
        torch.ones_like(tokens) if tp > 1 else None)
    pad = pad_token_id if pad_token_id is not None else eos_token_id
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool)
    out = tokens
    for _ in range(max_new_tokens):
        new = next_tokens(_last_logits(engine, out, mask, tp), sampling, generator)
        if eos_token_id is not None:
            new = new.masked_fill(finished, pad if pad is not None else eos_token_id)
            finished |= new == eos_token_id
        out = torch.cat([out, new[:, None].to(out.dtype)], dim=1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        if eos_token_id is not None and bool(finished.all()):
            break
    return out


def _last_logits(engine: Any, tokens: torch.Tensor, mask: torch.Tensor | None,
                 tp: int) -> torch.Tensor:
    if mask is None:
        return engine.logits(tokens)[:, -1]
    tokens, mask = _left_pad(tokens, mask, tp, 0)
    positions = positions_of(mask) if "position_ids" in engine.plan.inputs else None
    return engine.logits(tokens, attention_mask=mask, position_ids=positions)[:, -1]
