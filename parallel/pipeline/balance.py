"""Choosing ``balance``: cut a sequence of layers into K consecutive stages of even cost.

:func:`partition` is pure: given per-layer costs, the contiguous split into K parts that
minimises the largest part (dynamic programming over cut points, O(K n^2) for n
layers). :func:`balance_by_time` measures each layer's forward and backward time on a
sample; :func:`balance_by_size` uses each layer's parameter bytes plus the bytes of its
output on the sample (what a stage holds).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
from torch import nn


def partition(costs: Sequence[float], parts: int) -> list[int]:
    """Layers per part: ``parts`` contiguous groups of ``costs`` (each non-empty)
    minimising the largest group's sum.

    Raises:
        ValueError: if there are fewer layers than parts, or parts < 1.
    """
    n = len(costs)
    if parts < 1 or n < parts:
        raise ValueError(f"partition: cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    @cache
    def best(start: int, k: int) -> tuple[float, tuple[int, ...]]:
        """Smallest largest-part for layers[start:] in k parts, and the part sizes."""
        if k == 1:
            return prefix[n] - prefix[start], (n - start,)
        answer: tuple[float, tuple[int, ...]] = (float("inf"), ())
        for end in range(start + 1, n - k + 2):
            rest, sizes = best(end, k - 1)
            worst = max(prefix[end] - prefix[start], rest)
            if worst < answer[0]:
                answer = (worst, (end - start, *sizes))
        return answer

    return list(best(0, parts)[1])


def _layer_outputs(model: nn.Sequential, sample: Any) -> list[torch.Tensor]:
    outputs, x = [], sample
    for layer in model:
        x = layer(x)
        outputs.append(x)
    return outputs


def balance_by_size(num_stages: int, model: nn.Sequential, sample: Any) -> list[int]:
    """Balance on parameter bytes plus output bytes per layer (memory)."""
    with torch.no_grad():
        outputs = _layer_outputs(model, sample)
    costs = [sum(p.numel() * p.element_size() for p in layer.parameters())
             + out.numel() * out.element_size() for layer, out in zip(model, outputs, strict=True)]
    return partition(costs, num_stages)


def balance_by_time(num_stages: int, model: nn.Sequential, sample: Any,
                    repeats: int = 3) -> list[int]:
    """Balance on each layer's measured forward + backward time (median of ``repeats``)."""
    costs = []
    x = sample
    for layer in model:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = layer(x.detach())
    return partition(costs, num_stages)
