"""The models every layout is checked on: the project's GPT, HuggingFace's Llama, Qwen2,
Mistral and GPT-2 (built from configs, no download), a user's own block with
``nn.MultiheadAttention`` under a user plan, and a plain MLP. Each comes with the batches
it trains on; all are tiny (CPU, a few cores), with tied embeddings where the model has
an LM head, dropout 0.

``build(name, seed)`` gives the same weights on every call with the same seed (every
rank builds its own copy); ``plan_of(name, model)`` the plan to pass (None: the model's
own, as ``parallelize`` finds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pycomm.parallel._optional import require
from pycomm.parallel.models import GPT, GPTConfig
from pycomm.parallel.plans.plan import ContextRequest, Layer, Plan

ROWS = 8
HF = ("llama", "qwen2", "mistral", "gpt2")
LM = ("gpt", *HF, "myblock")
ALL = (*LM, "mlp")
# Not in ALL (the tests' zoo), for ``--models phi3,olmo2,cohere,granite,minicpm3``: families whose
# fused projections the model slices itself (rowwise_split_input; OLMo-2's norms over the
# gathered Q and K), or that scale embeddings or logits outside their modules (hf_scales).
EXTRA_HF: dict[str, dict[str, Any]] = {
    "phi3": {"pad_token_id": 0}, "olmo2": {"pad_token_id": 0},
    "cohere": {"pad_token_id": 0, "logit_scale": 0.25},
    "granite": {"pad_token_id": 0, "embedding_multiplier": 4.0, "logits_scaling": 2.0},
    # multi-head latent attention (mla_kv_a_proj): the rotary key's gradient summed over tp
    "minicpm3": {"pad_token_id": 0, "qk_rope_head_dim": 4,
                 "qk_nope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 8,
                 "num_key_value_heads": 4}}


@dataclass(frozen=True)
class Size:
    vocab: int = 64
    seq: int = 16
    width: int = 32
    layers: int = 4
    heads: int = 4


TINY = Size()
MEDIUM = Size(vocab=256, seq=128, width=256, layers=6, heads=8)  # ~4.9M parameters


def _hf(name: str, size: Size) -> nn.Module:
    tf = require("transformers", f"bench's HuggingFace model {name!r}")

    common = {"vocab_size": size.vocab, "hidden_size": size.width,
              "intermediate_size": 2 * size.width, "num_hidden_layers": size.layers,
              "num_attention_heads": size.heads, "num_key_value_heads": size.heads // 2,
              "max_position_embeddings": size.seq, "tie_word_embeddings": True,
              "attention_dropout": 0.0}
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=size.vocab, n_positions=size.seq, n_embd=size.width,
                               n_layer=size.layers, n_head=size.heads, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "sdpa"
        return tf.GPT2LMHeadModel(config)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
           "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
           "cohere": (tf.CohereConfig, tf.CohereForCausalLM),
           "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
           "minicpm3": (tf.MiniCPM3Config, tf.MiniCPM3ForCausalLM)}[name]
    config = cls[0](**{**common, **EXTRA_HF.get(name, {})})
    config._attn_implementation = "sdpa"
    return cls[1](config)


class UserBlock(nn.Module):
    """A user's own pre-norm block: torch's MultiheadAttention and an ``nn.Sequential``
    MLP, the same maths as the project's block. It takes the attention mask from its
    caller when given (the plan's context, so that every pipeline stage and every
    sequence-parallel rank uses the whole sequence's), and makes it otherwise."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is None:
            attn_mask = causal_mask(x.shape[1], x.device)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


def causal_mask(seq: int, device: Any) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


def user_block_plan(model: nn.Module) -> Plan:
    """The user's plan for a GPT whose blocks are :class:`UserBlock`: the attention is
    torch's MultiheadAttention split by heads, the MLP's two linears column- and
    row-parallel, the mask the whole sequence's, from the context."""

    def block(mods: Any, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return mods[0](x, attn_mask=ctx["mask"])

    def context(req: ContextRequest) -> dict[str, Any]:
        return {"mask": causal_mask(req.seq, req.device)}

    return Plan(layers=["embed", Layer(("blocks.*",), block), "ln_f", "lm_head"],
                blocks="blocks.*", context=context,
                tp={"embed.wte": "vocab_embedding", "blocks.*.attn": "mha",
                    "blocks.*.ff.0": "colwise", "blocks.*.ff.2": "rowwise",
                    "lm_head": "vocab_head"},
                divisible={"attention heads": model.blocks[0].attn.num_heads},
                name="GPT with UserBlock")


def _gpt(user_blocks: bool, size: Size) -> nn.Module:
    cfg = GPTConfig(vocab_size=size.vocab, block_size=size.seq, n_layer=size.layers,
                    n_head=size.heads, n_embd=size.width, tie_embeddings=True)
    model = GPT(cfg)
    if user_blocks:
        model.blocks = nn.ModuleList(UserBlock(size.width, size.heads)
                                     for _ in range(cfg.n_layer))
    return model


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def build(name: str, seed: int = 0, size: Size = TINY) -> nn.Module:
    """Model ``name`` with the weights of ``seed``."""
    torch.manual_seed(seed)
    if name in HF or name in EXTRA_HF:
        return _hf(name, size)
    if name == "mlp":
        return _mlp()
    return _gpt(name == "myblock", size)


def plan_of(name: str, model: nn.Module) -> Plan | None:
    return user_block_plan(model) if name == "myblock" else None


def batch(name: str, step: int, rows: int = ROWS, size: Size = TINY
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch for model ``name`` (tokens and next tokens; features
    and classes for the MLP)."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        return torch.randn(rows, 16, generator=gen), torch.randint(0, 10, (rows,), generator=gen)
    data = torch.randint(0, size.vocab, (rows, size.seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


@dataclass(frozen=True)
class Recipe:
    """The training every layout and the one-process reference share."""

    steps: int = 20
    lr: float = 1e-3
    weight_decay: float = 0.1
    clip: float = 1.0
    warmup: int = 3

    def lr_lambda(self) -> Callable[[int], float]:
        from pycomm.parallel.job.schedule import WarmupCosine

        return WarmupCosine(self.steps, self.warmup, 0.1)
