"""The project GPT's plan: the same mechanism as any user's model (no class checks).

Its forward is ``lm_head(ln_f(blocks(embed(tokens))))``, so those are its layers, each
block one. Tensor parallelism is Megatron-LM's: the fused Q, K, V projection is
column-parallel over three interleaved blocks (whole heads of each per rank), the
output projection row-parallel, the attention's head count is then this rank's, and its
dropout draws on the rank's own stream; the MLP is a column-parallel ``c_fc`` and a
row-parallel ``c_proj``; the token embedding and the head are split over the
vocabulary (and stay tied when the model ties them).

A GPT with experts (``GPTConfig(moe_experts=E)``) names them as a user's plan would: its
fused experts (``experts``: what expert parallelism splits; ``moe_tp_experts`` under tp,
the router replicated) and its routers with the load-balancing loss (``balance``: the
engine computes it over the whole global batch), as HuggingFace's Mixtral derives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..moe.balance import RouterBalance
from ..plans.plan import MODEL_INPUTS, ContextRequest, Layer, Plan
from ..tensor.styles import Colwise, LocalSizes, PerRankRandom
from .masks import attention_mask_of, with_mask


def gpt_context(request: ContextRequest) -> dict[str, Any]:
    """What the GPT's forward computes once for its blocks: the attention mask."""
    inputs = request.inputs
    if inputs is None:
        return {"mask": None}
    return {"mask": attention_mask_of(inputs.attention_mask, inputs.position_ids,
                                      request.seq, request.device)}


def embed_call(modules: Sequence[nn.Module], tokens: Any, context: dict[str, Any]) -> Any:
    inputs = context.get("inputs")
    return modules[0](tokens, inputs.position_ids if inputs is not None else None)


def block_call(modules: Sequence[nn.Module], x: Any, context: dict[str, Any]) -> Any:
    return with_mask(modules[0], x, context.get("mask"))


def gpt_plan(model: Any) -> Plan:
    """The plan of a :class:`pycomm.parallel.models.GPT`."""
    cfg = model.cfg
    return Plan(
        layers=[Layer(("embed",), embed_call), Layer(("blocks.*",), block_call), "ln_f",
                "lm_head"],
        blocks="blocks.*",
        context=gpt_context,
        inputs=MODEL_INPUTS,
        tp={
            "embed.wte": "vocab_embedding",
            "blocks.*.attn": (LocalSizes(("n_head",)), PerRankRandom()),
            "blocks.*.attn.c_attn": Colwise(interleave=3),
            "blocks.*.attn.c_proj": "rowwise",
            **_mlp_tp(cfg),
            "lm_head": "vocab_head",
        },
        divisible={"attention heads": cfg.n_head},
        init=model.init_module,
        experts=EXPERTS if cfg.moe_experts else None,
        balance=(RouterBalance(ROUTERS, cfg.moe_experts, cfg.moe_top_k, cfg.moe_aux_coef)
                 if cfg.moe_experts and cfg.moe_aux_coef else None),
        name="GPT",
    )


EXPERTS, ROUTERS = "blocks.*.mlp.experts", "blocks.*.mlp.gate"


def _mlp_tp(cfg: Any) -> dict[str, Any]:
    """The MLP's tensor parallelism: Megatron-LM's pair, or the experts by their
    intermediate units, the router replicated."""
    if cfg.moe_experts:
        return {EXPERTS: "moe_tp_experts", ROUTERS: "replicated"}
    return {"blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise"}
