"""Expert parallelism's dispatch and combine: each token's hidden state goes to the ranks
that hold its top-k experts, and the experts' outputs come back to be weighted and summed.

Over the ``ep`` group, with pycomm's dispatch and combine (:mod:`pycomm.dispatch_ops`):
every (token, choice) assignment is sorted by its expert, so the rows for each rank come
grouped by that rank's experts; one dispatch sends them with their counts per expert
(learned inside the op, so the receiver knows each row's local expert without another
exchange), the local experts compute them, one combine brings them back in the same
order, and each token sums its rows with its routing weights at its own rank (so the
weights' gradient stays local, as DeepEP's combine does). Each exchange's backward is
the other, so autograd carries the gradient back to each token and to each expert. On a
group of another backend the dispatch runs as two all_to_alls (counts, then rows).

Example::

    out = dispatch_combine(hidden, top_k_index, top_k_weights, local_experts, group,
                           experts_per_rank)   # local_experts(rows, local ids) -> rows
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pycomm.dispatch_ops import combine, dispatch


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor,
                     local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     group: Any, experts_per_rank: int,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k weight[t, k] * expert[index[t, k]](hidden[t])`` for every token ``t``, the
    experts split over ``group`` (rank ``r`` holds experts ``r * experts_per_rank`` on).

    Args:
        hidden: ``(tokens, hidden)``.
        top_k_index, top_k_weights: ``(tokens, k)``: each token's experts and weights.
        local_experts: ``fn(rows, local_ids) -> rows``: this rank's experts on the rows
            it received (``local_ids``: each row's expert among this rank's).
        group: the ``ep`` group.
        experts_per_rank: E / ep.
        keep: ``(tokens, k)`` booleans: only these assignments are sent (the others,
            dropped by a capacity, contribute nothing); None: all.

    Raises:
        ValueError: an expert index outside ``[0, E)``.
    """
    world = dist.get_world_size(group)
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    experts = experts_per_rank * world
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= experts):
        raise ValueError(f"expert parallel: expert index out of [0, {experts})"
                         f": {int(flat.min())}..{int(flat.max())}")
    # the assignments sent (assignment a = token * k + choice), by expert: by rank, then
    # its local expert
    sent = (torch.arange(flat.numel(), device=flat.device) if keep is None
            else keep.reshape(-1).nonzero().squeeze(1))
    experts_of = flat[sent]
    order = sent[torch.argsort(experts_of, stable=True)]
    send = torch.bincount(experts_of, minlength=experts).view(world, experts_per_rank)
    rows = hidden[order // k]
    arrived, received = dispatch(rows, send, group)
    local_ids = torch.arange(experts_per_rank).repeat(world).repeat_interleave(
        received.reshape(-1))
    done = local_experts(arrived, local_ids)
    back = combine(done, send, received, group)
    shape = (flat.numel(), back.shape[1])  # dropped assignments: nothing comes back
    whole = back.new_empty(shape) if keep is None else back.new_zeros(shape)
    by_assignment = whole.index_copy(0, order, back)
    weights = top_k_weights.reshape(tokens, k, 1).to(by_assignment.dtype)
    return (by_assignment.view(tokens, k, -1) * weights).sum(dim=1)
