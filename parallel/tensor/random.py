"""Random streams for dropout under tensor parallelism, and recomputation that replays them.

Dropout on a tensor every TP rank holds whole (the output of a row-parallel layer without
sequence parallelism) must drop the same elements on every rank, or the replicas
diverge; dropout on a split tensor (attention probabilities of a rank's own heads, or a
rank's part of the sequence) must drop independently on each rank, or the ranks repeat
one mask. So, as Megatron-LM's RNG tracker: besides torch's default generator, named
streams, ``"replicated"`` seeded alike on every TP rank and ``"tensor-parallel"`` seeded
per TP rank, and :meth:`RNGTracker.fork` runs a region on one of them. :func:`checkpoint`
saves every stream with its inputs (it is :func:`parallel.recompute.checkpoint`), so the
recomputation in backward draws the same masks as the forward did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TENSOR_PARALLEL = "tensor-parallel"
REPLICATED = "replicated"
_TP_SEED_OFFSET = 2718  # as Megatron-LM: the TP streams differ from the default one


class RNGTracker:
    """Named CPU generator states; :meth:`fork` swaps one in for a region."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(outside)

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Run the region on stream ``name``; it continues there next time.

        Raises:
            KeyError: if the stream was never seeded (call :func:`model_parallel_seed`).
        """
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} is not seeded: call "
                           "parallel.tensor.model_parallel_seed(seed, group) before training "
                           "with dropout")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

    def snapshot(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return torch.get_rng_state(), dict(self.states)

    def restore(self, snap: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        torch.set_rng_state(snap[0])
        self.states = dict(snap[1])


TRACKER = RNGTracker()


def model_parallel_seed(seed: int, group: dist.ProcessGroup | None) -> None:
    """Seed torch's generator with ``seed`` (the same on every TP rank), the replicated
    stream alike on every TP rank, and the tensor-parallel stream per TP rank."""
    torch.manual_seed(seed)
    TRACKER.reset()
    TRACKER.add(REPLICATED, seed + 1)
    TRACKER.add(TENSOR_PARALLEL, seed + _TP_SEED_OFFSET + dist.get_rank(group))


class TrackedDropout(nn.Module):
    """``nn.Dropout`` drawing from a named stream of :data:`TRACKER`."""

    def __init__(self, p: float, stream: str):
        super().__init__()
        self.p, self.stream = p, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with TRACKER.fork(self.stream):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}"


def checkpoint(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` without keeping its activations; backward recomputes them with every
    random stream (torch's and the tracker's) as they were in the forward. The same as
    :func:`parallel.recompute.checkpoint`, which also partitions or offloads inputs."""
    # imported here: parallel.recompute imports this module for TRACKER
    from parallel.recompute.checkpoint import checkpoint as recompute_checkpoint

    return recompute_checkpoint(fn, *args)
