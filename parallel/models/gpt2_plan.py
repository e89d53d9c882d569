"""How to write a plan for your own model, worked through on HuggingFace's GPT-2.

GPT-2's config declares no ``base_model_tp_plan`` or ``base_model_pp_plan``, so
:func:`pycomm.parallel.models.hf.hf_causal_lm_plan` refuses it; :func:`gpt2_plan` says by hand
what that derivation would have said. Reading ``GPT2LMHeadModel.forward`` (transformers'
``models/gpt2/modeling_gpt2.py``) gives each part of the plan:

1. **layers**: the forward as steps a pipeline can cut between. ``GPT2Model.forward``
   embeds the tokens (``wte``), adds the position embeddings (``wpe``), applies dropout
   (``drop``), runs the blocks ``h.0 ... h.{n-1}``, then ``ln_f``; the LM head follows.
   The first step is three modules combined in a way "one after the other" is not, so it
   gets a ``call``; ``"transformer.h.*"`` is one layer per block.
2. **blocks**: the repeated layers, ``"transformer.h.*"`` (what the pipeline balances,
   recompute checkpoints and ZeRO-3 gathers one at a time).
3. **context**: what the forward computes once and hands every block, here the causal
   mask. Each pipeline stage computes it itself, for the *whole* sequence (also where a
   rank holds a slice of it), with transformers' own ``create_causal_mask``
   (:func:`pycomm.parallel.models.hf.attention_mask`), so it is the mask the model would use.
4. **tp**: the Megatron-LM split by module path. GPT-2's ``Conv1D`` keeps its weight as
   ``(in, out)``, hence ``transposed=True``; ``c_attn`` computes Q, K and V side by side,
   so each third is split (``interleave=3``) and every rank gets whole heads of each.
   The attention's forward splits ``c_attn``'s output with ``split_size`` (the model
   width): on a rank it must be the rank's width, so :class:`LocalSizes` divides it (and
   ``num_heads``, to say the same; ``head_dim`` stays). The embedding and the head are
   split by vocabulary (the head's weight is the embedding's: tied, found by identity).
5. **divisible**: what the tensor-parallel size must divide (the heads; widths are
   checked by the parallel layers themselves). The vocabulary is split too, so it must
   be divisible by ``tp``: GPT-2's 50257 is not, pad it first
   (``model.resize_token_embeddings(50304)``).
6. **output**: the model's own forward returns a ``CausalLMOutputWithCrossAttentions``;
   :func:`pycomm.parallel.models.hf.logits_of` takes its ``.logits`` (and passes the last
   layer's plain tensor through), so the plan can be checked against the model itself.

Not in the plan: ``per_rank_random`` on ``attn``. GPT2Attention's ``resid_dropout`` falls
on ``c_proj``'s output, which every rank holds whole; drawing it from the per-rank stream
would make the replicas diverge. Its attention-probability dropout then draws the same
mask on every rank's heads, as a model without tensor parallelism would on those heads.

Example::

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50304))
    engine = parallelize(model, ParallelMesh(pp=2, dp=1, tp=2), ParallelConfig(),
                         plan=gpt2_plan(model))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..plans.plan import MODEL_INPUTS, ContextRequest, Layer, Plan
from ..tensor.styles import Colwise, LocalSizes, Rowwise
from .hf import attention_mask, hf_init, logits_of

H = "transformer.h.*"  # every block


def embed_call(modules: Sequence[nn.Module], tokens: torch.Tensor,
               context: dict[str, Any]) -> torch.Tensor:
    """``drop(wte(tokens) + wpe(positions))``, as ``GPT2Model.forward`` (the batch's
    position ids where it gives them)."""
    wte, wpe, drop = modules
    inputs = context.get("inputs")
    positions = inputs.position_ids if inputs is not None else None
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return drop(wte(tokens) + wpe(positions))


def block_call(modules: Sequence[nn.Module], x: torch.Tensor,
               context: dict[str, Any]) -> torch.Tensor:
    """One ``GPT2Block`` with the causal mask (older transformers return a tuple)."""
    out = modules[0](x, attention_mask=context["attention_mask"])
    return out[0] if isinstance(out, tuple) else out


def gpt2_plan(model: nn.Module) -> Plan:
    """The plan of a HuggingFace ``GPT2LMHeadModel`` (see the module docstring).

    Args:
        model: the model the plan is for (its config gives the mask and the head count).

    Raises:
        ValueError: if ``model`` has no ``transformer.h`` (it is not a GPT2LMHeadModel).
    """
    if not isinstance(getattr(getattr(model, "transformer", None), "h", None), nn.ModuleList):
        raise ValueError(f"gpt2_plan: {type(model).__name__} has no transformer.h: it is not "
                         "a GPT2LMHeadModel")
    config: Any = model.config

    def context(request: ContextRequest) -> dict[str, Any]:
        return {"attention_mask": attention_mask("full_attention", config, request)}

    return Plan(
        layers=[Layer(("transformer.wte", "transformer.wpe", "transformer.drop"), embed_call),
                Layer((H,), block_call), "transformer.ln_f", "lm_head"],
        blocks=H,
        tp={"transformer.wte": "vocab_embedding",
            "transformer.wpe": "replicated",
            f"{H}.attn.c_attn": Colwise(interleave=3, transposed=True),
            f"{H}.attn.c_proj": Rowwise(transposed=True),
            f"{H}.attn": LocalSizes(("split_size", "num_heads")),
            f"{H}.mlp.c_fc": Colwise(transposed=True),
            f"{H}.mlp.c_proj": Rowwise(transposed=True),
            "lm_head": "vocab_head"},
        context=context,
        output=logits_of,
        divisible={"attention heads": config.n_head},
        init=hf_init(model),
        inputs=MODEL_INPUTS,
        name=type(model).__name__)
