"""The project GPT's plan: the same mechanism as any user's model (no class checks).

Its forward is ``lm_head(ln_f(blocks(embed(tokens))))``, so those are its layers, each
block one. Tensor parallelism is Megatron-LM's: the fused Q, K, V projection is
column-parallel over three interleaved blocks (whole heads of each per rank), the
output projection row-parallel, the attention's head count is then this rank's, and its
dropout draws on the rank's own stream; the MLP is a column-parallel ``c_fc`` and a
row-parallel ``c_proj``; the token embedding and the head are split over the
vocabulary (and stay tied when the model ties them).
"""

from __future__ import annotations

from typing import Any

from parallel.compose.plan import Plan
from parallel.compose.styles import Colwise, LocalSizes, PerRankRandom


def gpt_plan(model: Any) -> Plan:
    """The plan of a :class:`parallel.models.GPT`."""
    return Plan(
        layers=["embed", "blocks.*", "ln_f", "lm_head"],
        blocks="blocks.*",
        tp={
            "embed.wte": "vocab_embedding",
            "blocks.*.attn": (LocalSizes(("n_head",)), PerRankRandom()),
            "blocks.*.attn.c_attn": Colwise(interleave=3),
            "blocks.*.attn.c_proj": "rowwise",
            "blocks.*.mlp.c_fc": "colwise",
            "blocks.*.mlp.c_proj": "rowwise",
            "lm_head": "vocab_head",
        },
        divisible={"attention heads": model.cfg.n_head},
        init=model.init_module,
        name="GPT",
    )
