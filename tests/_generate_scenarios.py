"""Generation with the parallel engine against the one-process model: greedy tokens equal
HuggingFace's ``generate``'s (a Llama, left-padded rows included), and the same function
run on one process's logits for the project's GPT and for sampling
(``tests/test_generate.py``)."""

from __future__ import annotations

from typing import Any

import torch

from tests import _real_batch_scenarios as rb

NEW = 6


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 6 tokens, the second left-padded by 2 (mask 0, pad 0)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, rb.VOCAB, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    return tokens.masked_fill(mask == 0, 0), mask


def trained(name: str) -> Any:
    """The model after a few steps on real batches, so that its greedy choices are not
    near-ties of an untrained model."""
    model = rb.build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        b = rb.batch("ignored", step)
        opt.zero_grad()
        logits = rb._logits(model, b)
        torch.nn.functional.cross_entropy(logits.reshape(-1, rb.VOCAB), b.targets.reshape(-1),
                                          ignore_index=rb.IGNORE).backward()
        opt.step()
    return model.eval()


def one_process(name: str, sampled: bool) -> dict[str, torch.Tensor]:
    """The reference tokens: HuggingFace's greedy ``generate`` where there is one, else the
    engine's sampling function on the one-process model's logits."""
    from pycomm.parallel.compose.generate import Sampling, next_tokens, positions_of

    model = trained(name)
    tokens, mask = prompts()
    out = {}
    for padded in (False, True):
        x, m = (tokens, mask) if padded else (tokens[:1], None)
        if name != "gpt" and not sampled:
            with torch.no_grad():
                out[f"padded={padded}"] = model.generate(
                    x, attention_mask=m if m is not None else torch.ones_like(x),
                    max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            continue
        sampling = Sampling(do_sample=sampled, temperature=0.8, top_k=5, seed=3)
        gen = torch.Generator().manual_seed(3) if sampled else None
        for _ in range(NEW):
            extra = {} if m is None else {"attention_mask": m, "position_ids": positions_of(m)}
            with torch.no_grad():
                logits = rb._logits(model, rb.Batch(x, x, **extra))[:, -1]
            x = torch.cat([x, next_tokens(logits, sampling, gen)[:, None]], dim=1)
            if m is not None:
                m = torch.cat([m, m.new_ones((m.shape[0], 1))], dim=1)
        out[f"padded={padded}"] = x
    return out


def layout(layout: str, name: str, sampled: bool) -> dict[str, torch.Tensor]:
    """The engine's tokens in ``layout`` (this pool's world)."""
    from pycomm.parallel.compose.parallelize import parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = rb.LAYOUTS[layout]
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    from pycomm.parallel.compose.config import ParallelConfig

    engine = parallelize(trained(name), mesh, ParallelConfig(**config))
    tokens, mask = prompts()
    kwargs: dict[str, Any] = {"do_sample": sampled, "temperature": 0.8, "top_k": 5, "seed": 3}
    out = {"padded=False": engine.generate(tokens[:1], NEW, **kwargs),
           "padded=True": engine.generate(tokens, NEW, attention_mask=mask, **kwargs)}
    mesh.destroy()
    return out
