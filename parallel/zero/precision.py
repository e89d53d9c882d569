"""Mixed precision for ZeRO: which dtype computes, which reduces, which the optimizer sees.

With ``mixed_precision=torch.bfloat16`` the model computes and communicates in bf16,
while each rank's optimizer steps an fp32 *master* copy of its shard (and keeps its
state in fp32). Gradients are reduced in ``reduce_dtype`` (bf16 unless fp32 is asked
for); the reduced shard is what clipping sees. A master needs an fp32 ``.grad``: when
the reduced shard is fp32 it is used as is, otherwise an fp32 copy exists only for
the step, as DeepSpeed does, so steady-state memory is the paper's ``2 + 2 + 12``
bytes per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Precision:
    master: torch.dtype  # the parameters' own dtype: optimizer and its state
    compute: torch.dtype  # forward, backward, gathers
    reduce: torch.dtype  # gradient reduction and the reduced shards

    @classmethod
    def choose(cls, master: torch.dtype, mixed_precision: torch.dtype | None,
               reduce_dtype: torch.dtype | None) -> Precision:
        """Raises ValueError for ``reduce_dtype`` without ``mixed_precision``, or a
        non-floating dtype."""
        if reduce_dtype is not None and mixed_precision is None:
            raise ValueError("ZeroOptimizer: reduce_dtype needs mixed_precision")
        for name, dtype in (("mixed_precision", mixed_precision), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"ZeroOptimizer: {name} must be a floating dtype, got {dtype}")
        compute = mixed_precision or master
        return cls(master, compute, reduce_dtype or compute)

    @property
    def mixed(self) -> bool:
        return self.compute != self.master


def step_on_masters(optimizer: torch.optim.Optimizer, masters: Sequence[nn.Parameter],
                    grads: Sequence[torch.Tensor]) -> None:
    """``optimizer.step()`` with each master's ``.grad`` the reduced shard (cast for the
    step alone if its dtype differs)."""
    cast = False
    for master, grad in zip(masters, grads, strict=True):
        if grad.dtype == master.dtype:
            master.grad = grad
        else:
            master.grad, cast = grad.to(master.dtype), True
    optimizer.step()
    if cast:
        for master in masters:
            master.grad = None
