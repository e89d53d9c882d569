"""The one random-number tracker of ``parallel/``: named streams, and the replay of them.

Dropout on a tensor every TP rank holds whole (the output of a row-parallel layer without
sequence parallelism) must drop the same elements on every TP rank, or the replicas
diverge; dropout on a split tensor (a rank's own attention heads, or its part of the
sequence) must drop independently on each rank, or the ranks repeat one mask. So, as
Megatron-LM's ``CudaRNGStatesTracker``: besides torch's default generators, named
streams (``"replicated"``, seeded alike on the TP ranks of a stage, and
``"tensor-parallel"``, seeded per TP rank), and :meth:`RNGTracker.fork` runs a region on
one of them. A stream is a CPU generator state and, once CUDA is initialized, one per
CUDA device; a fork swaps both the CPU generator and the current device's.

Every recomputation (:func:`pycomm.parallel.recompute.checkpoint`, ``Pipeline``'s
rematerialization through :meth:`RNGTracker.checkpoint_context`) takes a
:meth:`RNGTracker.snapshot` of *all* generators before the forward and
:meth:`RNGTracker.replay`\\ s it around the recomputation, so backward draws the forward's
masks and training continues from where the forward left every generator.

:func:`model_parallel_seed` seeds everything from ``(seed, tp rank, pp rank)``, with
Megatron-LM's offsets: ``100 * pp_rank`` per pipeline stage (stages hold different
layers, which must not draw identical masks) and ``2718 + tp_rank`` for the TP stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

TENSOR_PARALLEL = "tensor-parallel"
REPLICATED = "replicated"
TP_SEED_OFFSET = 2718  # as Megatron-LM: the TP streams differ from the default one
PP_SEED_STRIDE = 100  # as Megatron-LM's _set_random_seed: seed + 100 * pp_rank


def _cuda_device() -> int | None:
    """The current CUDA device, or None while CUDA is not initialized (asking a process
    that never touched CUDA would initialize it)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _seeded_cuda_state(seed: int, device: int) -> torch.Tensor:
    """The state of CUDA device ``device``'s generator after ``manual_seed(seed)``."""
    return torch.Generator(device=torch.device("cuda", device)).manual_seed(seed).get_state()


@dataclass
class _Stream:
    """One named stream: its seed, its CPU state, and its state on each CUDA device it was
    used on (made from the seed on first use, so seeding needs no CUDA)."""

    seed: int
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def seeded(cls, seed: int) -> _Stream:
        return cls(seed, torch.Generator().manual_seed(seed).get_state())

    def cuda_state(self, device: int) -> torch.Tensor:
        if device not in self.cuda:
            self.cuda[device] = _seeded_cuda_state(self.seed, device)
        return self.cuda[device]

    def copy(self) -> _Stream:
        # states are replaced, never written in place: copying the dict is enough
        return _Stream(self.seed, self.cpu, dict(self.cuda))


@dataclass(frozen=True)
class RNGSnapshot:
    """Every generator at one moment: torch's CPU one, each CUDA device's (None while
    CUDA is not initialized), and every named stream."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    streams: dict[str, _Stream]


class _Replay:
    """Context manager: the region runs with the generators of ``snap``, and leaves them
    as they were before it. Re-entrant, since a graph kept with ``retain_graph`` can be
    recomputed once per backward."""

    def __init__(self, tracker: RNGTracker, snap: RNGSnapshot):
        self.tracker, self.snap = tracker, snap
        self.outside: list[RNGSnapshot] = []

    def __enter__(self) -> None:
        self.outside.append(self.tracker.snapshot())
        self.tracker.restore(self.snap)

    def __exit__(self, *exc: object) -> None:
        self.tracker.restore(self.outside.pop())


class RNGTracker:
    """Named generator streams; :meth:`fork` swaps one in for a region."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self._active: list[str] = []  # the streams forked into, innermost last

    def reset(self) -> None:
        self.streams = {}

    def add(self, name: str, seed: int) -> None:
        """A stream ``name`` starting at ``seed`` (replacing one of that name)."""
        self.streams[name] = _Stream.seeded(seed)

    @contextmanager
    def _drawing_nothing(self, name: str) -> Iterator[None]:
        """The region of an unseeded stream, on the default generators: any draw there
        would be the same on every rank where it must differ, so it is refused."""
        def states() -> list[torch.Tensor]:
            device = _cuda_device()
            cuda = [torch.cuda.get_rng_state(device)] if device is not None else []
            return [torch.get_rng_state(), *cuda]

        before = states()
        yield
        after = states()
        if not all(map(torch.equal, before, after)):  # (CUDA's if it was initialized)
            raise KeyError(f"RNG stream {name!r} is not seeded: call "
                           "pycomm.parallel.rng.model_parallel_seed(seed, tp_group, pp_rank) "
                           f"before training with dropout (seeded: {sorted(self.streams)})")

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Run the region on stream ``name`` (CPU and current CUDA device); the stream
        continues there next time, and the default generators are as before the region.

        A fork into the stream already running is the region itself (a block forked
        whole that holds a layer which forks too): swapping again would replay the
        stream from where the outer fork began.

        Raises:
            KeyError: if the stream was never seeded (call :func:`model_parallel_seed`)
                and the region drew from it. A region that draws nothing (a model without
                dropout, or in eval) needs no seed.
        """
        if self._active and self._active[-1] == name:
            yield
            return
        if name not in self.streams:
            with self._drawing_nothing(name):
                yield
            return
        stream, device = self.streams[name], _cuda_device()
        outside_cpu = torch.get_rng_state()
        torch.set_rng_state(stream.cpu)
        if device is not None:
            outside_cuda = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(stream.cuda_state(device), device)
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()
            # by name, as Megatron-LM: a restore inside the region may have replaced it
            stream = self.streams.get(name, stream)
            stream.cpu = torch.get_rng_state()
            torch.set_rng_state(outside_cpu)
            if device is not None:
                stream.cuda[device] = torch.cuda.get_rng_state(device)
                torch.cuda.set_rng_state(outside_cuda, device)

    def snapshot(self) -> RNGSnapshot:
        """Every generator now (see :class:`RNGSnapshot`)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return RNGSnapshot(torch.get_rng_state(), cuda,
                           {name: s.copy() for name, s in self.streams.items()})

    def restore(self, snap: RNGSnapshot) -> None:
        """Every generator back to ``snap``."""
        torch.set_rng_state(snap.cpu)
        if snap.cuda is not None:
            torch.cuda.set_rng_state_all(snap.cuda)
        self.streams = {name: s.copy() for name, s in snap.streams.items()}

    def replay(self, snap: RNGSnapshot) -> AbstractContextManager[None]:
        """A region that draws what was drawn after ``snap`` and leaves every generator
        as it found it: a recomputation in backward."""
        return _Replay(self, snap)

    def checkpoint_context(self) -> tuple[AbstractContextManager[None],
                                          AbstractContextManager[None]]:
        """``context_fn`` for ``torch.utils.checkpoint`` (``use_reentrant=False``): the
        recomputation replays every generator and stream as the forward found them. Pass
        ``preserve_rng_state=False`` too: this covers what torch would restore."""
        return nullcontext(), self.replay(self.snapshot())


TRACKER = RNGTracker()


def model_parallel_seed(seed: int, tp_group: Any = None, pp_rank: int = 0) -> None:
    """Seed every generator for this rank's place in a (pipeline, tensor) layout.

    With ``stage_seed = seed + 100 * pp_rank`` (Megatron-LM's offsets): torch's default
    generators (CPU, every CUDA device) and the ``"replicated"`` stream (``stage_seed +
    1``) are alike on the TP ranks of a stage, the ``"tensor-parallel"`` stream
    (``stage_seed + 2718 + tp_rank``) differs per TP rank, and every stream differs per
    stage. Data-parallel replicas get the same seeds, as in Megatron-LM. Since torch's
    default generator differs per stage, build the model (its initial weights) before
    this call, or seed it yourself for that.

    Args:
        seed: the run's seed, the same on every rank.
        tp_group: the tensor-parallel group (None: the default group).
        pp_rank: this rank's pipeline stage (0 without pipeline parallelism).

    Raises:
        ValueError: if ``pp_rank`` is negative or this rank is not in ``tp_group``.
    """
    tp_rank = dist.get_rank(tp_group)
    if tp_rank < 0:
        raise ValueError(f"model_parallel_seed: global rank {dist.get_rank()} is not in the "
                         "tp_group it was given")
    seed_streams(seed, tp_rank, pp_rank)


def seed_from_mesh(seed: int, mesh: Any, tp_dim: str = "tp", pp_dim: str = "pp") -> None:
    """:func:`model_parallel_seed` from a ``torch.distributed.DeviceMesh``: this rank's
    coordinates along ``tp_dim`` and ``pp_dim`` (0 along a dimension the mesh lacks)."""
    names = tuple(mesh.mesh_dim_names or ())

    def coordinate(dim: str) -> int:
        return int(mesh.get_local_rank(dim)) if dim in names else 0

    seed_streams(seed, coordinate(tp_dim), coordinate(pp_dim))


def seed_streams(seed: int, tp_rank: int, pp_rank: int) -> None:
    """:func:`model_parallel_seed` from the coordinates themselves (no group needed)."""
    if pp_rank < 0 or tp_rank < 0:
        raise ValueError(f"model_parallel_seed: pp_rank ({pp_rank}) and tp_rank ({tp_rank}) "
                         "must be >= 0")
    stage_seed = seed + PP_SEED_STRIDE * pp_rank
    torch.manual_seed(stage_seed)  # CPU and every CUDA device
    TRACKER.reset()
    TRACKER.add(REPLICATED, stage_seed + 1)
    TRACKER.add(TENSOR_PARALLEL, stage_seed + TP_SEED_OFFSET + tp_rank)
