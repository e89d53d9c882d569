"""The data-parallel side of a composed job: who reduces the gradients over ``dp``, which
optimizer steps, and which part of the gradients each rank holds afterwards (for the
global norm). Plain data parallelism averages whole gradients; ZeRO keeps shards."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from parallel.compose.mesh import ParallelMesh
from parallel.data.grad_average import GradAverager
from parallel.tensor.sharding import spec_of


class DataParallelPlan(Protocol):
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def reduce(self) -> None:
        """Phase 2 of finalize_grads: the reduction over ``dp``."""

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        """This rank's gradients after the reduction, each with 1 / its copies."""

    def local_state(self, names: dict[int, str]) -> dict[str, Any]:
        """Each parameter (this rank's TP part, whole over ``dp``) and its optimizer
        state, by model name (collective over ``dp``)."""

    def load_local_state(self, wanted: dict[int, dict[str, Any]]) -> None:
        """The inverse, from ``id(parameter)`` -> that (collective over ``dp``)."""


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors (biases, norms) do not: the usual GPT recipe."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def tp_copies(p: torch.Tensor, mesh: ParallelMesh) -> int:
    """How many tensor-parallel ranks hold the same gradient as this one."""
    return mesh.size("tp") if spec_of(p).dim is None else 1


class PlainDataParallel:
    """Whole gradients averaged over ``dp`` (every replica then holds the same)."""

    def __init__(self, params: list[nn.Parameter], mesh: ParallelMesh, config: Any):
        self.params, self.mesh = params, mesh
        self.averager = GradAverager(params, mesh.group("dp"), config.bucket_mb)
        self.optimizer = config.optimizer(param_groups(params, config.weight_decay),
                                          **config.optimizer_kwargs)

    def reduce(self) -> None:
        self.averager()

    def grad_parts(self) -> list[tuple[torch.Tensor, float]]:
        dp = self.mesh.size("dp")
        return [(p.grad, 1.0 / (dp * tp_copies(p, self.mesh)))
                for p in self.params if p.grad is not None]

    def local_state(self, names: dict[int, str]) -> dict[str, Any]:
        """Each parameter (this rank's TP part) and its optimizer state, by model name."""
        return {names[id(p)]: {"param": p.detach().clone(), "spec": _spec_tuple(p),
                               "state": _cloned(self.optimizer.state.get(p, {}))}
                for p in self.params}

    @torch.no_grad()
    def load_local_state(self, wanted: dict[int, dict[str, Any]]) -> None:
        for p in self.params:
            p.copy_(wanted[id(p)]["param"])
            if wanted[id(p)]["state"]:
                self.optimizer.state[p] = _cloned(wanted[id(p)]["state"])


def _spec_tuple(p: torch.Tensor) -> tuple[int | None, int]:
    spec = spec_of(p)
    return spec.dim, spec.interleave


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def build_data_parallel(stage: nn.Module, params: list[nn.Parameter], mesh: ParallelMesh,
                        config: Any) -> DataParallelPlan:
    """The plan for ``config.zero`` (0: plain data parallelism)."""
    if config.zero == 0:
        return PlainDataParallel(params, mesh, config)
    from parallel.compose.zero_plan import ZeroPlan  # (it imports this module's helpers)

    return ZeroPlan(stage, params, mesh, config)
