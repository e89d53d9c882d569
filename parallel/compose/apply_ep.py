"""Expert parallelism applied to this stage's fused experts, in place: each rank of the
``ep`` group keeps ``E / ep`` experts (a slice of every expert tensor along its first
dimension) and the module's forward dispatches each token to the ranks holding its
experts and combines their outputs (:func:`pycomm.parallel.moe.dispatch.dispatch_combine`).

The module's own code computes the local experts (HuggingFace's ``*Experts``: given rows,
each row's local expert and weight 1), so its activation and layout are the model's. The
parameters are marked ``expert_parallel`` (the data side reduces their gradients over the
expert-data-parallel group) and carry their place in the whole tensor (``row_slice``:
checkpoints and pretrained weights read and write that slice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..moe.dispatch import dispatch_combine
from ..plans.plan import Plan, matching, under_any
from .materialize import is_meta

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def _checked(module: nn.Module, path: str, ep: int) -> int:
    experts = getattr(module, "num_experts", None)
    tensors = [getattr(module, n, None) for n in EXPERT_TENSORS]
    if not isinstance(experts, int) or not all(isinstance(t, nn.Parameter) and t.dim() == 3
                                                 and t.shape[0] in (experts, experts // ep)
                                                 for t in tensors):
        raise TypeError(f"expert parallel: {path} is a {type(module).__name__}, not fused "
                        f"experts ({EXPERT_TENSORS} of shape (num_experts, ...))")
    if experts % ep:
        raise ValueError(f"expert parallel: {path} has {experts} experts, which ep = {ep} "
                         "does not divide")
    return experts


def split_experts(module: nn.Module, path: str, group: Any) -> None:
    """This rank's experts of ``module`` and the dispatching forward (see the module
    docstring). Tensors of ``E / ep`` experts are already this rank's (a model built on
    the meta device materializes only them)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = _checked(module, path, ep) // ep
    for name in EXPERT_TENSORS:
        whole: Any = getattr(module, name)
        mine = (whole.detach() if whole.shape[0] == per_rank  # made for this rank alone
                else whole.detach()[rank * per_rank:(rank + 1) * per_rank].clone())
        part = nn.Parameter(mine, requires_grad=whole.requires_grad)
        part.expert_parallel = True  # type: ignore[attr-defined]
        part.row_slice = (rank * per_rank, ep * per_rank)  # type: ignore[attr-defined]
        setattr(module, name, part)
    module.num_experts = per_rank  # type: ignore[assignment]
    forward = module.forward

    def local(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return forward(rows, ids.unsqueeze(-1), ones)

    def dispatched(hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, keep: torch.Tensor | None = None
                   ) -> torch.Tensor:
        return dispatch_combine(hidden, top_k_index, top_k_weights, local, group, per_rank,
                                keep)

    module.forward = dispatched
    module.dispatches = True  # type: ignore[assignment]
    module.experts_total = ep * per_rank  # type: ignore[assignment]


def expert_parallel(model: nn.Module, plan: Plan, held: list[str], group: Any,
                    materializer: Any) -> list[str]:
    """Split every fused experts module of the stage over ``group`` (one on the meta
    device: only this rank's experts materialized); returns their paths.

    Raises:
        ValueError: the plan names no experts, or E is not divisible by ep.
    """
    if plan.experts is None:
        raise ValueError(f"expert parallel: the plan for {plan.name} names no experts "
                         "(Plan.experts); ep > 1 has nothing to split")
    done, ep = [], dist.get_world_size(group)
    for path in matching(plan.experts, model):
        if under_any(path, held):
            module = model.get_submodule(path)
            if is_meta(module):
                per_rank = _checked(module, path, ep) // ep
                materializer.experts(path, module, dist.get_rank(group) * per_rank, per_rank)
            split_experts(module, path, group)
            done.append(path)
    return done


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "expert_parallel", False))
