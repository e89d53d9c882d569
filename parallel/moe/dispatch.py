"""Expert parallelism's dispatch and combine: each token's hidden state goes to the ranks
that hold its top-k experts, and the experts' outputs come back to be weighted and summed.

Over the ``ep`` group (``all_to_all_single`` with uneven splits, its counts exchanged
first): every (token, choice) assignment is sorted by the rank holding its expert,
sent, computed there by the local experts, sent back in the same order, and summed per
token with its routing weight at the token's own rank (so the weights' gradient stays
local, as DeepEP's combine does). Both exchanges are :class:`_AllToAll`, whose backward is
the exchange the other way, so autograd carries the gradient back to each token and to
each expert.

Example::

    out = dispatch_combine(hidden, top_k_index, top_k_weights, local_experts, group,
                           experts_per_rank)   # local_experts(rows, local ids) -> rows
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Forward: rows sent ``send`` per rank, received ``recv`` per rank. Backward: the
    gradient's rows the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def _counts(send: torch.Tensor, group: Any) -> list[int]:
    """Every rank's count for this one (one all-to-all of one element each)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(c) for c in recv]


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor,
                     local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     group: Any, experts_per_rank: int) -> torch.Tensor:
    """``sum_k weight[t, k] * expert[index[t, k]](hidden[t])`` for every token ``t``, the
    experts split over ``group`` (rank ``r`` holds experts ``r * experts_per_rank`` on).

    Args:
        hidden: ``(tokens, hidden)``.
        top_k_index, top_k_weights: ``(tokens, k)``: each token's experts and weights.
        local_experts: ``fn(rows, local_ids) -> rows``: this rank's experts on the rows
            it received (``local_ids``: each row's expert among this rank's).
        group: the ``ep`` group.
        experts_per_rank: E / ep.

    Raises:
        ValueError: an expert index outside ``[0, E)``.
    """
    world = dist.get_world_size(group)
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= experts_per_rank * world):
        raise ValueError(f"expert parallel: expert index out of [0, {experts_per_rank * world})"
                         f": {int(flat.min())}..{int(flat.max())}")
    owner = flat // experts_per_rank
    order = torch.argsort(owner, stable=True)
    send = [int(c) for c in torch.bincount(owner, minlength=world)]
    recv = _counts(torch.tensor(send, dtype=torch.int64), group)
    rows = hidden[order // k]  # the assignment's token (assignment a = token * k + choice)
    local_ids = _exchange((flat[order] - owner[order] * experts_per_rank).unsqueeze(-1),
                          send, recv, group).squeeze(-1)
    arrived = _AllToAll.apply(rows, send, recv, group)
    done = local_experts(arrived, local_ids)
    back = _AllToAll.apply(done, recv, send, group)
    by_assignment = torch.empty_like(back).index_copy(0, order, back)
    weights = top_k_weights.reshape(tokens, k, 1).to(by_assignment.dtype)
    return (by_assignment.view(tokens, k, -1) * weights).sum(dim=1)
