"""Tiny HuggingFace causal LMs built without downloads, and what each rank runs for the
tensor-parallel checks of tests/test_hf_plans.py: a plan's tp styles applied by hand over
the world group, the (gathered) logits compared with the one-process model's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Small enough to build in milliseconds; 4 heads and 2 key-value heads (GQA) where the
# family has them; a sliding window (4) shorter than the probe's 8 tokens, so that a wrong
# mask shows. Only the keys a family's config has are passed.
SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, head_dim=16, max_position_embeddings=64,
    sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)
# model type -> overrides of SMALL (a key set to None is left at the family's default)
EXTRA: dict[str, dict[str, Any]] = {
    "codegen": {"rotary_dim": 8},  # its default (64) exceeds the tiny head_dim
    "gptj": {"rotary_dim": 8},
    "youtu": {"head_dim": None},  # MLA: the head size comes from the rope/nope dims
    "deepseek_v3": {"head_dim": None},
    "axk1": {"head_dim": None},
    "glm4_moe_lite": {"head_dim": None, "num_key_value_heads": 4},  # MLA: kv heads = heads
    # the families below have no sdpa path
    "gemma2": {"attn_implementation": "eager"},
    "vaultgemma": {"attn_implementation": "eager"},
    "gpt_oss": {"attn_implementation": "eager"},
    "granite_swa": {"attn_implementation": "eager"},
    "flint": {"attn_implementation": "eager"},
    "mimo_v2_flash": {"attn_implementation": "eager"},
    "hy_v4": {"attn_implementation": "eager"},
    "deepseek_v4": {"attn_implementation": "eager"},
}
TOKENS = (torch.arange(16) * 37 % 256).reshape(2, 8)


def classes(model_type: str) -> tuple[type, type] | None:
    """The config and causal-LM classes of ``model_type``, or None where this
    transformers has none."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = CONFIG_MAPPING_NAMES.get(model_type), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if not all(names) or not all(hasattr(transformers, str(n)) for n in names):
        return None
    return getattr(transformers, str(names[0])), getattr(transformers, str(names[1]))


def build(model_type: str, **overrides: Any) -> nn.Module:
    """A tiny ``model_type`` causal LM (fp32, weights from seed 0, eval mode)."""
    found = classes(model_type)
    assert found is not None, f"transformers has no causal LM {model_type!r}"
    config_cls, model_cls = found
    default = config_cls()
    wanted = {**SMALL, "attn_implementation": "sdpa", **EXTRA.get(model_type, {}), **overrides}
    kwargs = {k: v for k, v in wanted.items()
              if v is not None and (hasattr(default, k) or k == "attn_implementation")}
    if getattr(default, "layer_types", None) is not None and "layer_types" not in overrides:
        kwargs["layer_types"] = None  # the default lists every layer of the full model
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).eval()


def gpt2(**overrides: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    kwargs = {**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=32,
                     bos_token_id=1, eos_token_id=2, attn_implementation="sdpa"), **overrides}
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**kwargs)).eval()


def plan_for(model_type: str, model: nn.Module) -> Any:
    from pycomm.parallel.models.gpt2_plan import gpt2_plan
    from pycomm.parallel.models.hf import hf_causal_lm_plan

    return gpt2_plan(model) if model_type == "gpt2" else hf_causal_lm_plan(model)


def apply_tp(model: nn.Module, plan: Any, group: Any, world: int) -> list[str]:
    """Every tp style of ``plan`` on the modules its pattern matches (a module replaced
    is set on its parent); returns the paths changed, in order."""
    from pycomm.parallel.plans.plan import matching
    from pycomm.parallel.tensor.styles import TPContext, style_of

    done = []
    for pattern, spec in plan.tp.items():
        style = style_of(spec, pattern)
        for path in matching(pattern, model):
            module = model.get_submodule(path)
            ctx = TPContext(group, world, path, sequence_parallel=False, parallel_loss=False)
            new = style.apply(module, ctx)
            if new is not module:
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent), name, new)
            done.append(path)
    return done


def tp_difference(model_type: str, overrides: dict[str, Any]) -> float:
    """This rank's largest difference between the one-process logits and those of the
    model split by its plan's tp styles over the world group (tp = world size)."""
    from pycomm.parallel.compose.layers import sequential_forward
    from pycomm.parallel.rng import model_parallel_seed

    model = gpt2(**overrides) if model_type == "gpt2" else build(model_type, **overrides)
    plan = plan_for(model_type, model)
    with torch.no_grad():
        want = model(TOKENS).logits
    model_parallel_seed(0, dist.group.WORLD)  # per_rank_random forks the TP stream
    apply_tp(model, plan, dist.group.WORLD, dist.get_world_size())
    with torch.no_grad():
        got = sequential_forward(model, plan, TOKENS)
    return float((got - want).abs().max())
