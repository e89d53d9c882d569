"""Rank side of ``bench.step_time``: one model under one layout, over one backend's
groups, as the step function a user would time.

Every layout gets its own copy of the model (the same seed, so the same weights) and
AdamW. Torch's layouts (DDP, FSDP2) are what a user writes by hand; the trainer's
layouts (dp, ZeRO-3, tp, pp) are ``pycomm.parallel.parallelize`` on a mesh whose groups all
belong to the cell's backend, so the same ranks can hold gloo, pycomm and fake engines
side by side and take turns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench import _model_zoo as zoo
from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
from pycomm.parallel.mesh import DIMS, MeshShape, ParallelMesh

# -arena: the torch layout built and stepped in pycomm.use_arena(), so the buffers it
# allocates (DDP's buckets, with gradients as bucket views; FSDP2's all-gather and
# reduce-scatter buffers) are in the shared-memory arena and pycomm's collectives on
# them are zero-copy
LAYOUTS = ("ddp", "ddp-arena", "fsdp2", "fsdp2-arena", "dp", "zero3", "tp", "pp")
# The trainer's layouts at 2 ranks, as (pp, dp, tp, ZeRO stage).
ENGINE = {"dp": (1, 2, 1, 0), "zero3": (1, 2, 1, 3), "tp": (1, 1, 2, 0), "pp": (2, 1, 1, 0)}
MICROBATCHES = 2  # the pipeline's M (each micro-batch: half the global batch)
LR = 1e-4
GROUP_TIMEOUT = timedelta(seconds=120)  # a failed peer surfaces as an error, not a hang

Step = Callable[[int], float]


@dataclass(frozen=True)
class Work:
    """What every cell of a job shares: the model and the global batch."""

    model: str  # "gpt" or "llama" (bench._model_zoo names)
    size: zoo.Size
    batch: int  # sequences per step over all ranks (data-parallel ranks split them)


def unsupported(layout: str, backend: str) -> str | None:
    """Why a cell cannot run at all, decided before trying (a try could hang or OOM)."""
    if layout == "pp" and backend == "fake":
        return ("fake backend: its recv leaves the pipeline's shape header unwritten "
                "(send/recv are not simulated), so stage 1 cannot size its input")
    return None


@contextlib.contextmanager
def default_group(group: dist.ProcessGroup) -> Iterator[None]:
    """Make ``group`` the default group for a while. The trainer's engine sums the
    gradient norm over the default group (``finalize.global_grad_norm``), and a user of
    one backend would have it as the default; swapping it keeps every collective of a
    cell on the cell's backend while other backends' models live in the same ranks."""
    world = dist.distributed_c10d._world
    saved = world.default_pg
    world.default_pg = group
    try:
        yield
    finally:
        world.default_pg = saved


def backend_groups(backend: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The backend's group of every rank and this rank's own one-rank group (the mesh's
    size-1 dimensions). Collective over the world, in the same order on every rank."""
    if backend == "fake":
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    world = (dist.group.WORLD if backend == dist.get_backend() else
             dist.new_group(backend=backend, timeout=GROUP_TIMEOUT))
    singles = [dist.new_group([r], backend=backend, timeout=GROUP_TIMEOUT)
               for r in range(dist.get_world_size())]
    assert world is not None
    return world, singles[dist.get_rank()]


class BackendMesh(ParallelMesh):
    """A 2-rank :class:`ParallelMesh` on given groups: ``init_device_mesh`` would make
    its groups on the default backend; here they are the cell's. At most one dimension
    is larger than 1 (every layout of this benchmark), and it spans the world."""

    def __init__(self, pp: int, dp: int, tp: int, world: dist.ProcessGroup,
                 single: dist.ProcessGroup):
        self.shape = MeshShape(pp, dp, tp)
        self.shape.check_world(dist.get_world_size())
        sizes = {d: getattr(self.shape, d) for d in DIMS}
        assert sum(s > 1 for s in sizes.values()) <= 1, "one dimension > 1 only"
        self._groups = {d: world if sizes[d] > 1 else single for d in DIMS}
        self._coords = {d: dist.get_rank() if sizes[d] > 1 else 0 for d in DIMS}


def _blocks(net: nn.Module) -> nn.ModuleList:
    """The transformer blocks: GPT's ``blocks``, a HuggingFace model's ``model.layers``."""
    blocks = getattr(net, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        blocks = net.get_submodule("model.layers")
    assert isinstance(blocks, nn.ModuleList)
    return blocks


def _fully_shard(net: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """FSDP2 as its docs wrap a transformer: each block, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in _blocks(net):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _fake_allreduce_hook(group, bucket):
    """DDP's default hook (all-reduce the bucket, then divide by the world), for the fake
    backend: its Work's future holds None, where DDP's reducer needs the bucket back, so
    the bucket is handed back here, averaged as after a real all-reduce. (No annotations:
    DDP checks ``bucket``'s is the GradBucket class, and here they would be strings.)"""
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda _: buffer.div_(dist.get_world_size(group)))


def _user_step(work: Work, net: nn.Module) -> Step:
    """The loop a torch user writes: this rank's rows, forward, loss, backward, step."""
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = work.batch // world

    def step(i: int) -> float:
        x, y = zoo.batch(work.model, i, work.batch, work.size)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        out = net(x)
        logits = out.logits if hasattr(out, "logits") else out  # HF returns a ModelOutput
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _engine_step(work: Work, layout: str, net: nn.Module, world: dist.ProcessGroup,
                 single: dist.ProcessGroup) -> Step:
    """The trainer's engine: ``engine.train_step`` on the global batch (each replica
    takes its rows; the pipeline splits it into micro-batches). No clipping, as the
    torch loops; the engine still sums the gradient norm (one scalar all-reduce)."""
    pp, dp, tp, zero = ENGINE[layout]
    config = ParallelConfig(zero=zero, microbatches=MICROBATCHES if pp > 1 else 1,
                            max_grad_norm=None, optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": LR}, seed=0)
    engine = parallelize(net, BackendMesh(pp, dp, tp, world, single), config)

    def step(i: int) -> float:
        x, y = zoo.batch(work.model, i, work.batch, work.size)
        return engine.train_step(x, y).loss

    return step


def _torch_layout(work: Work, layout: str, net: nn.Module, world: dist.ProcessGroup) -> Step:
    """DDP or FSDP2 as their docs wrap a model; the -arena layouts in pycomm.use_arena."""
    import pycomm

    in_arena = layout.endswith("-arena")
    block = pycomm.use_arena if in_arena else contextlib.nullcontext
    with block():
        if layout.startswith("fsdp2"):
            wrapped = _fully_shard(net, world)
        else:
            wrapped = DDP(net, process_group=world, gradient_as_bucket_view=in_arena)
            if dist.get_backend(world) == "fake":
                wrapped.register_comm_hook(world, _fake_allreduce_hook)
    user_step = _user_step(work, wrapped)

    def step(i: int) -> float:
        with block():  # DDP rebuilds its buckets in the second forward; FSDP2 allocates
            return user_step(i)  # its buffers every step

    return step


def build_step(work: Work, layout: str, world: dist.ProcessGroup,
               single: dist.ProcessGroup) -> Step:
    """The step of ``layout`` over these groups (call under :func:`default_group`)."""
    net = zoo.build(work.model, seed=0, size=work.size)
    if layout.startswith(("ddp", "fsdp2")):
        return _torch_layout(work, layout, net, world)
    if layout in ENGINE:
        return _engine_step(work, layout, net, world, single)
    raise ValueError(f"step_time: unknown layout {layout!r}; choose from {LAYOUTS}")
