"""Which parameters a forward pass did not use (DDP's ``find_unused_parameters``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def _grad_fns(outputs: object) -> list[torch.autograd.graph.Node]:
    """The autograd nodes of every tensor in ``outputs`` (tensors, nested lists/dicts)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs.grad_fn] if outputs.grad_fn is not None else []
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        return [fn for item in outputs for fn in _grad_fns(item)]
    return []


def reachable_params(outputs: object, params: Sequence[nn.Parameter]) -> set[int]:
    """Indices of ``params`` that backward from ``outputs`` will reach."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[torch.autograd.graph.Node] = set()
    found: set[int] = set()
    stack = _grad_fns(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold the leaf
        if variable is not None and id(variable) in index:
            found.add(index[id(variable)])
        stack.extend(next_fn for next_fn, _ in node.next_functions if next_fn is not None)
    return found


def names_of(indices: Iterable[int], names: Sequence[str]) -> list[str]:
    return [names[i] for i in sorted(indices)]
