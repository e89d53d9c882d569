"""GPipe (Huang et al., 2019) with its stages on meshes of different islands.

Each stage (a module built on its worker by ``build_stage(stage, n_stages)``) lives on
a one-worker mesh, as a future the controller holds. A step is dispatched whole: per
micro-batch, the forward of every stage, the loss and backward of the last, then the
backward of every earlier stage, then each stage's optimizer step. Activations and their
gradients are futures: they move worker to worker (shared memory inside an island, gloo
between islands), never through the controller, and with their shapes declared the
receiver has posted its receive before the sender has the value. The gradients of the
micro-batches add up in micro-batch order on every stage, as in one process that
accumulates them in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .client import Client, Mesh
from .futures import Future
from .mesh_context import MeshContext
from .protocol import Spec


@dataclass
class _Stage:
    module: nn.Module
    optimizer: torch.optim.Optimizer
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def build(ctx: MeshContext, build_stage: Callable[[int, int], nn.Module], stage: int,
          n_stages: int, lr: float) -> _Stage:
    module = build_stage(stage, n_stages)
    return _Stage(module, torch.optim.SGD(module.parameters(), lr=lr))


def forward(ctx: MeshContext, state: _Stage, micro: int, x: torch.Tensor) -> torch.Tensor:
    """A middle or first stage: keep the graph for the backward, send the output on."""
    x = x.detach().requires_grad_(x.is_floating_point())
    y = state.module(x)
    state.saved[micro] = (x, y)
    return y.detach()


def last(ctx: MeshContext, state: _Stage, micro: int, x: torch.Tensor, target: torch.Tensor,
         loss_fn: Callable[..., torch.Tensor], scale: float) -> tuple[float, torch.Tensor]:
    """The last stage: the micro-batch's loss, its backward, the input's gradient."""
    x = x.detach().requires_grad_(True)
    loss = loss_fn(state.module(x), target)
    (loss * scale).backward()
    assert x.grad is not None
    return float(loss.detach()), x.grad


def backward(ctx: MeshContext, state: _Stage, micro: int, grad: torch.Tensor) -> Any:
    """An earlier stage: the backward of its saved graph; the input's gradient (or None
    on the first stage, whose input is data)."""
    x, y = state.saved.pop(micro)
    y.backward(grad)
    return x.grad


def update(ctx: MeshContext, state: _Stage) -> None:
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


class IslandPipeline:
    """A GPipe pipeline whose ``len(meshes)`` stages live on ``meshes`` (one worker each).

    Args:
        client: the controller.
        meshes: one one-worker mesh per stage (any islands).
        build_stage: ``build_stage(stage, n_stages) -> nn.Module``, run on the stage's
            worker (a module-level function: it is sent by reference).
        loss_fn: ``loss_fn(output, target)``, also module-level.
        lr: the stages' SGD learning rate.
        activation: the :class:`Spec` of each stage's output per micro-batch (its
            gradient's too), so receivers post before senders have the data; or None.

    Raises:
        ValueError: a stage mesh of more than one worker (data parallelism inside a stage
            is not built here), or fewer than two stages.
    """

    def __init__(self, client: Client, meshes: list[Mesh],
                 build_stage: Callable[[int, int], nn.Module],
                 loss_fn: Callable[..., torch.Tensor], lr: float,
                 activation: Spec | None = None):
        if len(meshes) < 2:
            raise ValueError(f"IslandPipeline: two or more stage meshes, got {len(meshes)}")
        bad = [i for i, m in enumerate(meshes) if m.size != 1]
        if bad:
            raise ValueError(f"IslandPipeline: one worker per stage (data parallelism inside "
                             f"a stage is not built here); stages {bad} have "
                             f"{[meshes[i].size for i in bad]} workers")
        self.client, self.meshes, self.loss_fn, self.activation = (
            client, meshes, loss_fn, activation)
        n = len(meshes)
        self.stages = [client.call(build, m, build_stage, i, n, lr)
                       for i, m in enumerate(meshes)]

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[Future]:
        """Dispatch one step over these micro-batches; the futures of their losses."""
        c, meshes, stages, spec = self.client, self.meshes, self.stages, self.activation
        scale = 1.0 / len(inputs)
        losses, grads = [], []
        for m, (x, target) in enumerate(zip(inputs, targets, strict=True)):
            h: Any = x
            for s in range(len(meshes) - 1):
                h = c.call(forward, meshes[s], stages[s], m, h, out=spec)
            loss, grad = c.call(last, meshes[-1], stages[-1], m, h, target, self.loss_fn,
                                scale, out=(None, spec))
            losses.append(loss)
            grads.append(grad)
        for s in reversed(range(len(meshes) - 1)):
            grads = [c.call(backward, meshes[s], stages[s], m, g, out=spec if s else None)
                     for m, g in enumerate(grads)]
        for s, mesh in enumerate(meshes):
            c.call(update, mesh, stages[s])
        return losses
