"""The project's reference model: a small GPT (nanoGPT-like) that every strategy runs.

Token and position embeddings, ``n_layer`` pre-norm blocks of causal self-attention and
a GELU MLP, a final LayerNorm and an LM head. Attention keeps Q, K and V in one
``c_attn`` linear and the MLP is ``c_fc`` then ``c_proj``, the names Megatron-style
tensor parallelism splits by. ``GPTConfig(tie_embeddings=True)`` ties the LM head to the
token embedding, as nanoGPT and GPT-2 do. :meth:`GPT.parallel_plan` says how every
strategy splits it (:mod:`pycomm.parallel.models.gpt_plan`).

``GPTConfig(moe_experts=E, moe_top_k=k)`` makes every block's MLP a mixture of E experts,
each token routed to k of them: HuggingFace Mixtral's sparse block, SwiGLU experts
included (:mod:`pycomm.parallel.models.gpt_moe`). Its objective is the cross-entropy plus
``moe_aux_coef`` times the routers' load-balancing loss, which :meth:`GPT.forward_with_aux`
returns beside the logits (the engine computes it over the global batch itself).

Beside the tokens it takes HuggingFace's model inputs: an ``attention_mask`` (1 for a real
token, 0 for padding, left or right) and ``position_ids`` (restarting at 0 at each
document packed into a row; attention then stays inside each document).

Example::

    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))
    logits = model(tokens)                       # (batch, time, vocab)
    loss = lm_loss(logits, targets)

    moe = GPT(GPTConfig(n_embd=64, moe_experts=4, moe_top_k=2, moe_aux_coef=0.01))
    logits, aux = moe.forward_with_aux(tokens)
    loss = lm_loss(logits, targets) + moe.cfg.moe_aux_coef * aux
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gpt_moe import (
    Experts,
    SparseMoE,
    TopKRouter,
    load_balancing_loss,
    router_logits,
)
from .masks import attention_mask_of, with_mask


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False
    # A mixture of experts in every block (0: the dense GELU MLP): E experts, each token
    # routed to the top k, the load-balancing loss weighted by moe_aux_coef (Switch
    # Transformer's 0.01; 0: none), each expert moe_intermediate wide (None: 4 * n_embd,
    # the dense MLP's width).
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_aux_coef: float = 0.01
    moe_intermediate: int | None = None

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )
        if self.moe_experts < 0:
            raise ValueError(f"GPTConfig: moe_experts={self.moe_experts} must be >= 0 (0: "
                             "the dense MLP)")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"GPTConfig: moe_top_k={self.moe_top_k} must be in 1 .. "
                             f"moe_experts={self.moe_experts}")
        if self.moe_aux_coef < 0:
            raise ValueError(f"GPTConfig: moe_aux_coef={self.moe_aux_coef} must be >= 0")
        if self.moe_intermediate is not None and self.moe_intermediate < 1:
            raise ValueError(f"GPTConfig: moe_intermediate={self.moe_intermediate} must be "
                             ">= 1 (None: 4 * n_embd)")

    @property
    def expert_width(self) -> int:
        """Each expert's intermediate units."""
        return self.moe_intermediate or 4 * self.n_embd


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: (batch, 1, time, time), True where a query may attend to a key (see
        :func:`pycomm.parallel.models.masks.attention_mask_of`); None: causal."""
        batch, time, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # Heads come from the last dimension, so a column-split c_attn (whole heads per
        # rank) needs no change here: n_head is then the local head count.
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                           is_causal=mask is None)
        y = y.transpose(1, 2).reshape(batch, time, -1)
        # (the residual dropout is the block's: this module draws only on its heads)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp: nn.Module = MLP(cfg) if not cfg.moe_experts else SparseMoE(
            cfg.n_embd, cfg.moe_experts, cfg.moe_top_k, cfg.expert_width, cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.resid_dropout(with_mask(self.attn, self.ln_1(x), mask))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        if tokens.shape[1] > self.wpe.num_embeddings:
            raise ValueError(f"GPT: sequence length {tokens.shape[1]} exceeds block_size "
                             f"{self.wpe.num_embeddings}")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(position_ids))


class GPT(nn.Module):
    """Embedding, ``n_layer`` blocks, final LayerNorm and LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.wte.weight
        for name, module in self.named_modules():
            self.init_module(name, module)

    def init_module(self, path: str, module: nn.Module) -> None:
        """Initialise one module's own parameters: normal(0, 0.02) for linears and
        embeddings (GPT-2's scaled std for the residual projections ``c_proj``, as
        nanoGPT does; the experts' ``down_proj`` likewise), zero biases, unit norms."""
        scaled_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = scaled_std if path.endswith("c_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, TopKRouter):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
            nn.init.normal_(module.down_proj, mean=0.0, std=scaled_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def parallel_plan(self) -> Any:
        """How every strategy of ``parallel/`` splits this model."""
        from .gpt_plan import gpt_plan

        return gpt_plan(self)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens, position_ids)
        mask = attention_mask_of(attention_mask, position_ids, tokens.shape[1], tokens.device)
        for block in self.blocks:
            x = with_mask(block, x, mask)
        return self.lm_head(self.ln_f(x))

    def forward_with_aux(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the routers' load-balancing loss over every layer and every
        real token (transformers' ``aux_loss``, without the coefficient; zero for the dense
        GPT). One process's objective is ``lm_loss + cfg.moe_aux_coef * aux``."""
        with router_logits(self) as logits:
            out = self(tokens, attention_mask, position_ids)
        aux = load_balancing_loss(logits, self.cfg.moe_experts, self.cfg.moe_top_k,
                                  attention_mask)
        return out, aux.to(out.device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens and their next-token targets, from ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]
