"""The project GPT's mixture-of-experts MLP: HuggingFace Mixtral's sparse block.

A router (a bias-free linear ``n_embd -> E``, softmax over all E experts, the top k
renormalised to sum to 1) and fused experts (``gate_up_proj`` ``(E, 2I, H)``,
``down_proj`` ``(E, H, I)``, each expert ``down(silu(gate(h)) * up(h))``: Mixtral's
SwiGLU, whose packed gate and up projection is what ``moe_tp_experts`` splits), laid out
as transformers' ``MixtralTopKRouter`` and ``MixtralExperts`` are: expert parallelism and
tensor parallelism split them as they split any HuggingFace experts, and the engine's
load balance tracks the router as it tracks Mixtral's (its forward returns ``(logits,
scores, indices)``). :func:`load_balancing_loss` is transformers'
``load_balancing_loss_func``: what one process adds to its loss, times the coefficient.

Example::

    block = SparseMoE(n_embd=64, experts=4, top_k=2, intermediate=128)
    y = block(x)                                   # (batch, time, 64)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..precision import widened


class TopKRouter(nn.Module):
    """Each token's top-k experts and their weights (Mixtral's ``MixtralTopKRouter``)."""

    def __init__(self, n_embd: int, experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.weight = nn.Parameter(torch.empty(experts, n_embd))

    def forward(self, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``(tokens, n_embd)`` -> the logits ``(tokens, E)``, the chosen
        experts' weights and indices ``(tokens, k)``. The softmax is in fp32 (or the
        model's wider dtype), as Mixtral's."""
        logits = F.linear(hidden.reshape(-1, self.weight.shape[1]), self.weight)
        top, index = widened(logits).softmax(dim=-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


class Experts(nn.Module):
    """E SwiGLU experts in two fused tensors (Mixtral's ``MixtralExperts``)."""

    def __init__(self, n_embd: int, experts: int, intermediate: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, n_embd))
        self.down_proj = nn.Parameter(torch.empty(experts, n_embd, intermediate))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k weight_k * expert_{index_k}(h)`` for each row of ``hidden``; an index
        outside ``0 .. E-1`` contributes nothing. Every expert runs, on no rows where none
        chose it, so every expert tensor has a gradient in every step."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, (y * top_k_weights[rows, slot, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """The block's MLP as a mixture of experts: route every token, then its experts
    (Mixtral's ``MixtralSparseMoeBlock``, without its jitter noise), then dropout as the
    dense MLP's."""

    def __init__(self, n_embd: int, experts: int, top_k: int, intermediate: int,
                 dropout: float = 0.0):
        super().__init__()
        self.gate = TopKRouter(n_embd, experts, top_k)
        self.experts = Experts(n_embd, experts, intermediate)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(hidden)
        return self.dropout(self.experts(hidden, index, weights).reshape(x.shape))


@contextmanager
def router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block: every router of ``model`` appends its logits to the list it
    yields, layer after layer (HuggingFace's ``output_router_logits``)."""
    found: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _args, out: found.append(out[0]))
             for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()


def load_balancing_loss(logits: list[torch.Tensor], experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func``
    computes it: ``E * sum_e (T_e / R) * (P_e / R)`` over every layer's ``logits``
    ``(batch * seq, E)``, ``T_e`` the tokens whose top-k has expert ``e``, ``P_e`` the sum
    of its softmax probability, ``R`` the rows, each counted only where
    ``attention_mask`` ``(batch, seq)`` is 1 (padding excluded). Zero without logits."""
    if not logits:
        return torch.zeros(())
    dtype = widened(logits[0]).dtype
    counts = torch.zeros(experts, dtype=dtype, device=logits[0].device)
    probs, rows = torch.zeros_like(counts), torch.zeros((), dtype=dtype, device=counts.device)
    for layer in logits:
        p = widened(layer).softmax(dim=-1)
        chosen = p.topk(top_k, dim=-1).indices
        real = (torch.ones(p.shape[0], dtype=dtype, device=p.device) if attention_mask is None
                else attention_mask.reshape(-1).to(device=p.device, dtype=dtype))
        counts = counts.scatter_add(0, chosen.reshape(-1), real.repeat_interleave(top_k))
        probs = probs + (p * real[:, None]).sum(dim=0)
        rows = rows + real.sum()
    return experts * ((counts / rows) * (probs / rows)).sum()
