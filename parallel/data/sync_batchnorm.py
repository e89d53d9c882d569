"""Batch normalisation over the whole data-parallel batch, on CPU tensors as on GPU ones.

A BatchNorm layer normalises by its batch's statistics, so a replica that normalises its
own rows trains another model than one process on the whole batch. As torch's
``SyncBatchNorm`` (CUDA only), :class:`DataParallelBatchNorm` takes the mean and the
variance over every replica's rows, through all-reduces that autograd differentiates
(:func:`pycomm.parallel.tensor.comms.sum_over_group`: the backward all-reduces the
gradients), and updates the running statistics with the global ones, so every replica
keeps the running statistics one process would.

The statistics are two-pass (the global mean first, then the global sum of squared
deviations from it), as exact as the one-process layer's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..tensor.comms import sum_over_group


class DataParallelBatchNorm(_BatchNorm):
    """A BatchNorm layer (any dimensionality) whose batch is every replica's rows; built
    from an existing layer by :meth:`replacing`, sharing its parameters and buffers (the
    state dict's names and values stay)."""

    group: Any

    @classmethod
    def replacing(cls, bn: _BatchNorm, group: Any) -> DataParallelBatchNorm:
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        new.weight, new.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, name, getattr(bn, name))
        new.train(bn.training)
        new.group = group
        return new

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DataParallelBatchNorm: expected an input of 2 or more "
                             f"dimensions (batch, features, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)  # the running statistics: nothing to share
        shape = [1, -1] + [1] * (input.dim() - 2)
        dims = [0, *range(2, input.dim())]
        # every replica holds as many rows (the engine splits the batch evenly)
        total = float(input.numel() // input.shape[1] * dist.get_world_size(self.group))
        mean = sum_over_group(input.sum(dims), self.group) / total
        centred = input - mean.view(shape)
        var = sum_over_group(centred.square().sum(dims), self.group) / total
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), total)
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        """As ``F.batch_norm`` does: the unbiased variance, by ``momentum`` (None: the
        cumulative average over the batches seen)."""
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = var * (total / max(total - 1.0, 1.0))
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def batchnorm_paths(module: nn.Module) -> list[str]:
    """The BatchNorm layers of ``module``, by path."""
    return [path for path, m in module.named_modules() if path and isinstance(m, _BatchNorm)]


def sync_batchnorm(module: nn.Module, group: Any) -> list[str]:
    """Every BatchNorm layer of ``module`` made a :class:`DataParallelBatchNorm` over
    ``group`` (in place: each is set on its parent); returns their paths."""
    paths = [p for p in batchnorm_paths(module)
             if not isinstance(module.get_submodule(p), DataParallelBatchNorm)]
    for path in paths:
        parent, _, name = path.rpartition(".")
        owner = module.get_submodule(parent)
        bn = owner.get_submodule(name)
        assert isinstance(bn, _BatchNorm)
        setattr(owner, name, DataParallelBatchNorm.replacing(bn, group))
    return paths


__all__ = ["DataParallelBatchNorm", "batchnorm_paths", "sync_batchnorm"]
