"""Plain data parallelism as the data side of a composed job: whole gradients averaged
over ``dp``, every replica steps the same optimizer.

With mixed precision (the model computing in bf16 or fp16) the optimizer steps fp32
master copies of the parameters, its state in fp32: after backward each gradient is
cast to fp32 into its master's ``.grad`` and averaged there (``reduce_dtype`` fp32, the
default; bf16 averages the low-precision gradients, then casts), and after the step the
masters are copied back into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpointing.optim_groups import ensure_state, param_groups
from ..data.grad_average import GradAverager
from ..mesh import ParallelMesh
from .apply_ep import is_expert

# (parameter, its shape, flat start, master values, optimizer state tensors, scalar state)
Piece = tuple[nn.Parameter, torch.Size, int, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]


class PlainDataParallel:
    """Whole gradients averaged over ``dp``; see the module docstring.

    Args:
        params: this rank's parameters, in the master dtype (fp32).
        mesh, config: the job's.
        compute: the dtype forward and backward run in.
        copies: ``copies(p)``: how many ranks of one replica hold the same gradient
            (tensor-parallel replicas, pipeline copies of a tie), for the global norm.
    """

    def __init__(self, params: list[nn.Parameter], mesh: ParallelMesh, config: Any,
                 compute: torch.dtype, copies: Callable[[nn.Parameter], int]):
        # the experts' last: their gradients are reduced over their own group
        params = [p for p in params if not is_expert(p)] + [p for p in params if is_expert(p)]
        self.params, self.mesh, self.copies = params, mesh, copies
        self.mixed = any(p.dtype != compute for p in params)
        with torch.no_grad():
            self.masters = ([nn.Parameter(p.detach().float().clone()) for p in params]
                            if self.mixed else params)
            for p in params if self.mixed else []:
                p.data = p.data.to(compute)
        low_reduce = self.mixed and config.reduce_dtype != torch.float32
        reduced = params if low_reduce else self.masters
        dense = sum(not is_expert(p) for p in params)
        self.averagers = [GradAverager(reduced[:dense], mesh.group("dp"), config.bucket_mb)]
        if dense < len(params):  # summed over edp, over all dp replicas' tokens
            self.averagers.append(GradAverager(reduced[dense:], mesh.group("edp"),
                                               config.bucket_mb, divide_by=mesh.size("dp")))
        self.low_reduce = low_reduce
        self.optimizer = config.optimizer(param_groups(self.masters, config.weight_decay),
                                          **config.optimizer_kwargs)

    def _average(self) -> None:
        for averager in self.averagers:
            averager()

    def reduce(self) -> None:
        if not self.mixed:
            self._average()
            return
        if self.low_reduce:
            self._average()
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = p.grad.float()  # type: ignore[union-attr]
            return
        # Each low-precision gradient cast into its master's view of the fp32 buffer.
        views = [v for averager in self.averagers for v in averager.views]
        for p, m, view in zip(self.params, self.masters, views, strict=True):
            view.copy_(p.grad) if p.grad is not None else view.zero_()
            p.grad, m.grad = None, view
        self._average()

    @torch.no_grad()
    def after_step(self) -> None:
        """The masters' new values into the model's low-precision parameters."""
        if self.mixed:
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        if self.mixed:
            for p in [*self.params, *self.masters]:
                p.grad = None
        else:  # the gradients are the averaging buffer's views, zeroed in place
            for averager in self.averagers:
                averager.zero()

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        replicas = {False: self.mesh.size("dp"), True: self.mesh.size("edp")}
        return [(m.grad, 1.0 / (replicas[is_expert(p)] * self.copies(p)))
                for p, m in zip(self.params, self.masters, strict=True) if m.grad is not None]

    def pieces(self) -> list[Piece]:
        """For checkpoints: each parameter (this rank's tensor-parallel part) whole, as
        (parameter, flat start 0, its master values, its optimizer state tensors, its
        scalar state), all flat views of the live tensors."""
        ensure_state(self.optimizer)
        out = []
        for p, m in zip(self.params, self.masters, strict=True):
            state = self.optimizer.state[m]
            tensors = {k: v.view(-1) for k, v in state.items()
                       if torch.is_tensor(v) and v.shape == m.shape}
            scalars = {k: v for k, v in state.items() if k not in tensors}
            out.append((p, p.shape, 0, m.detach().view(-1), tensors, scalars))
        return out

    def set_scalars(self, p: nn.Parameter, scalars: dict[str, Any]) -> None:
        index = next(i for i, q in enumerate(self.params) if q is p)
        self.optimizer.state[self.masters[index]].update(
            {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})

    def release_view(self) -> None:
        """(Checkpoints read and write the parameters and state in memory.)"""
        return None

    def saved(self) -> None:
        """(Checkpoints read the parameters and state in place: nothing to finish.)"""

    def loaded(self) -> None:
        """After a checkpoint was read into the masters: the model gets their values."""
        self.after_step()
