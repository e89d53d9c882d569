"""Per-parameter gradient-ready hooks and one callback at the end of backward, shared by
the strategies that reduce gradients while backward runs (data parallel, ZeRO)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def on_grad_ready(params: Sequence[torch.Tensor], fn: Callable[[int, torch.Tensor], None]) -> None:
    """Call ``fn(index, param)`` each time a parameter's gradient is accumulated."""
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda param, i=i: fn(i, param))


def move_grad_into(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` hold ``param.grad`` and become it (a fresh gradient moves into its
    preallocated home; one already there is left alone)."""
    grad = param.grad
    if grad is not None and grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
        param.grad = view


class EndOfBackward:
    """Runs ``fn`` once when the current backward finishes, however often it is requested."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self._queued = False

    def request(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def reset(self) -> None:
        """Forget a request whose backward failed before it finished (its callback is
        dropped with it), so the next backward queues again."""
        self._queued = False

    def _run(self) -> None:
        self._queued = False
        self._fn()
