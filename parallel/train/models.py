"""The models the trainer builds: the project's GPT, or a HuggingFace causal LM from a
config (``llama``, ``qwen2``, ``mistral``, ``gpt2``: byte-level, vocabulary 256, sized by
the model flags; ``hf:CONFIG.json``: a config of the user's, as transformers reads it).
HuggingFace models need the optional extra ``pip install pycomm[hf]`` (transformers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel._optional import require
from parallel.models import GPT, GPTConfig

NAMED = ("gpt", "llama", "qwen2", "mistral", "gpt2")
VOCAB = 256  # bytes


def _transformers() -> Any:
    return require("transformers", "parallel.train's HuggingFace models")


def hf_config(cfg: Any) -> Any:
    """The HuggingFace config ``--model`` names, sized by the model flags."""
    tf = _transformers()
    if cfg.model.startswith("hf:"):
        config = tf.AutoConfig.from_pretrained(cfg.model.removeprefix("hf:"))
        if config.vocab_size < VOCAB:
            raise ValueError(f"train: {cfg.model} has vocab_size {config.vocab_size}; the "
                             f"trainer's data are bytes (it needs >= {VOCAB})")
        return config
    if cfg.model == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                             n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
                             embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=0,
                             eos_token_id=0, tie_word_embeddings=cfg.tie_embeddings)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
    return cls[cfg.model](
        vocab_size=VOCAB, hidden_size=cfg.n_embd, intermediate_size=4 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head, max_position_embeddings=cfg.block_size,
        attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings)


def build_model(cfg: Any) -> nn.Module:
    """The model of ``cfg`` (built from ``cfg.seed``; on the meta device with
    ``--init meta``: each rank then materializes only what it holds)."""
    torch.manual_seed(cfg.seed)
    device = torch.device("meta") if cfg.init == "meta" else torch.device("cpu")
    with device:
        if cfg.model == "gpt":
            return GPT(GPTConfig(vocab_size=VOCAB, block_size=cfg.block_size,
                                 n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                 dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings))
        config = hf_config(cfg)
        config._attn_implementation = "sdpa"
        return _transformers().AutoModelForCausalLM.from_config(config)


def describe_model(cfg: Any, model: nn.Module) -> str:
    """``GPT`` or the HuggingFace class, with its shape."""
    name = "GPT" if cfg.model == "gpt" else type(model).__name__
    shape = (f"n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd}"
             if not cfg.model.startswith("hf:") else cfg.model)
    return f"{name} ({shape}, block_size={cfg.block_size}, bytes)"
