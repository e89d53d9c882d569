"""The models the trainer builds: the project's GPT, or a HuggingFace causal LM from a
config (``llama``, ``qwen2``, ``mistral``, ``gpt2``, sized by the model flags;
``hf:CONFIG.json``: a config of the user's, as transformers reads it). The vocabulary is the
data's: 256 for bytes, the tokenizer's with ``--tokenizer`` (the caller passes it).
HuggingFace models need the optional extra ``pip install pycomm-collectives[hf]`` (transformers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._optional import require
from ..models import GPT, GPTConfig

NAMED = ("gpt", "llama", "qwen2", "mistral", "gpt2")
VOCAB = 256  # bytes: the vocabulary without --tokenizer


def _transformers() -> Any:
    return require("transformers", "pycomm.parallel.train's HuggingFace models")


def _data(cfg: Any, vocab: int) -> str:
    """What the model's tokens are: bytes, or the tokenizer's ids."""
    tokenizer = getattr(cfg, "tokenizer", "")
    return f"{tokenizer}'s vocabulary of {vocab}" if tokenizer else "bytes"


def hf_config(cfg: Any, vocab: int = VOCAB) -> Any:
    """The HuggingFace config ``--model`` names, sized by the model flags, for data of
    ``vocab`` token ids."""
    tf = _transformers()
    if cfg.model.startswith("hf:") or getattr(cfg, "from_pretrained", ""):
        source = getattr(cfg, "from_pretrained", "") or cfg.model.removeprefix("hf:")
        config = tf.AutoConfig.from_pretrained(source)
        if config.vocab_size < vocab:
            raise ValueError(f"train: {cfg.model} has vocab_size {config.vocab_size}; the "
                             f"trainer's data ({_data(cfg, vocab)}) need >= {vocab}")
        return config
    if cfg.model == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                             n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
                             embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=0,
                             eos_token_id=0, tie_word_embeddings=cfg.tie_embeddings)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
    return cls[cfg.model](
        vocab_size=vocab, hidden_size=cfg.n_embd, intermediate_size=4 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head, max_position_embeddings=cfg.block_size,
        attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings)


def gpt_config(cfg: Any, vocab: int = VOCAB) -> GPTConfig:
    """The project GPT's config for ``cfg``, with its experts where ``--moe-experts``."""
    return GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout,
                     tie_embeddings=cfg.tie_embeddings,
                     moe_experts=getattr(cfg, "moe_experts", 0),
                     moe_top_k=getattr(cfg, "moe_top_k", 2),
                     moe_aux_coef=getattr(cfg, "moe_aux_coef", 0.01))


def build_model(cfg: Any, vocab: int = VOCAB) -> nn.Module:
    """The model of ``cfg`` for ``vocab`` token ids (built from ``cfg.seed``; on the meta
    device with ``--init meta``: each rank then materializes only what it holds)."""
    torch.manual_seed(cfg.seed)
    pretrained = getattr(cfg, "from_pretrained", "")
    meta = cfg.init == "meta" or pretrained  # pretrained weights are read after the split
    device = torch.device("meta") if meta else torch.device("cpu")
    with device:
        if cfg.model == "gpt" and not pretrained:
            return GPT(gpt_config(cfg, vocab))
        config = hf_config(cfg, vocab)
        config._attn_implementation = "sdpa"
        return _transformers().AutoModelForCausalLM.from_config(config)


def describe_model(cfg: Any, model: nn.Module, vocab: int = VOCAB) -> str:
    """``GPT`` or the HuggingFace class, with its shape."""
    pretrained = getattr(cfg, "from_pretrained", "")
    name = "GPT" if cfg.model == "gpt" and not pretrained else type(model).__name__
    shape = (f"pretrained {pretrained}" if pretrained else cfg.model if
             cfg.model.startswith("hf:") else
             f"n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd}")
    experts = getattr(cfg, "moe_experts", 0) if name == "GPT" else 0
    if experts:
        shape += f", {experts} experts top-{cfg.moe_top_k} (aux coef {cfg.moe_aux_coef})"
    return f"{name} ({shape}, block_size={cfg.block_size}, {_data(cfg, vocab)})"
