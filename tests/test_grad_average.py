"""GradAverager (the composed job's data-parallel averaging) on 2 gloo ranks, float64:
the average of every gradient across several buckets, a missing gradient counting as
zeros, and the same layout as DataParallel's (GradLayout: one way to place and bucket)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pycomm.testing import run_ranks

SHAPES = [(3,), (100,), (7, 5), (1000,), (2, 2)]
BUCKET_MB = 1e-3  # ~1 KB buckets: the 5 gradients span several


def _rank_grad(shape: tuple[int, ...], rank: int, index: int) -> torch.Tensor:
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=torch.float64) * (rank + 1) + index).view(shape)


def _average_on_ranks() -> dict:
    from pycomm.parallel.data.grad_average import GradAverager

    rank = dist.get_rank()
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    averager = GradAverager(params, None, bucket_mb=BUCKET_MB)
    averager.zero()
    for i, p in enumerate(params):
        if i != 2 or rank == 0:  # the third has no gradient on rank 1: zeros there
            p.grad = _rank_grad(p.shape, rank, i)  # not the buffer's view: copied in
    averager()
    inside = all(v.data_ptr() == p.grad.data_ptr() for v, p in zip(averager.views, params,
                                                                      strict=True))
    return {"grads": [p.grad.clone() for p in params], "spans": len(averager.spans),
            "views_are_grads": inside}


def test_gradients_are_averaged_across_buckets_and_a_missing_one_counts_as_zeros():
    results = run_ranks(_average_on_ranks, 2, backend="gloo")
    for got in results:
        assert got["spans"] > 1, "the test needs several buckets to bite"
        assert got["views_are_grads"]
        for i, (shape, grad) in enumerate(zip(SHAPES, got["grads"], strict=True)):
            ranks = [0] if i == 2 else [0, 1]
            expected = sum(_rank_grad(shape, r, i) for r in ranks) / 2
            assert torch.equal(grad, expected), f"gradient {i} {shape}"
