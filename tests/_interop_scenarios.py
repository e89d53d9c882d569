"""Rank-side torch training scenarios, written as a user would, for any backend.

Each scenario runs inside an initialised default process group, uses only
public torch APIs, and returns CPU tensors and floats so that the pytest
process can compare one backend's run with another's and with the
single-process reference in ``_interop_models``.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from _interop_models import (
    MODELS,
    STEPS,
    global_batch,
    make_optimizer,
    mlp,
    params_of,
    rank_slice,
)
from torch import nn

BUCKET_CAP_MB = 0.001  # ~1 KB: the MLP's gradients span three DDP buckets
PP_MICROBATCHES = 4


def run_scenarios(names: list[str]) -> dict[str, dict]:
    """Run the named scenarios in order in this rank; results by scenario name."""
    return {name: SCENARIOS[name]() for name in names}


def _perturb_off_root(net: nn.Module) -> None:
    """Make non-root replicas differ, so DDP's initial broadcast is really tested."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(float(dist.get_rank()))


def _ddp(model: str = "mlp", micro: int = 1, **ddp_kwargs) -> dict:
    """SGD-momentum steps on per-rank data under DistributedDataParallel.

    With ``micro`` > 1, all but the last micro-batch run under ``no_sync()``,
    so gradients accumulate locally and are all-reduced once per step.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    net = MODELS[model]()
    _perturb_off_root(net)
    ddp = DDP(net, bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)
    opt = make_optimizer(ddp.parameters(), "sgd")
    losses = []
    for step in range(STEPS):
        for m in range(micro):
            x, y = global_batch(step * micro + m, world, model)
            with ddp.no_sync() if m < micro - 1 else nullcontext():
                loss = nn.functional.mse_loss(ddp(rank_slice(x, rank)), rank_slice(y, rank))
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    # Private, but the only way to see the buckets as rebuilt after step one.
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    return {"params": params_of(net), "losses": losses, "buckets": buckets}


def _fsdp2() -> dict:
    """Adam steps under FSDP2 ``fully_shard``, per layer and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    net = mlp()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = make_optimizer(net.parameters(), "adam")
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, world)
        loss = nn.functional.mse_loss(net(rank_slice(x, rank)), rank_slice(y, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor().detach().clone() for p in net.parameters()]
    return {"params": full, "losses": losses}


def _tensor_parallel() -> dict:
    """SGD steps on a column/row-parallel MLP; every rank sees the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    net = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = make_optimizer(net.parameters(), "sgd")
    result: dict = {"losses": []}
    for step in range(STEPS):
        x, y = global_batch(step, world)
        x.requires_grad_(step == 0)  # the input gradient needs ColwiseParallel's all-reduce
        out = net(x)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        if step == 0:
            result["out"], result["x_grad"] = out.detach(), x.grad
            result["grads"] = [_full(p.grad) for p in net.parameters()]
        opt.step()
        opt.zero_grad()
        result["losses"].append(loss.item())
    result["params"] = [_full(p) for p in net.parameters()]
    return result


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (or a plain tensor), detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _pipeline(schedule: str) -> dict:
    """A pipeline schedule over two stages (MLP layers [0:2] and [2:]), with micro-batches.

    Rank 0 feeds the whole batch; the last rank holds the targets and the loss.
    ``scale_grads`` (the default) divides by the micro-batch count, so the
    gradients equal those of the global mean loss.
    """
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the pipeline scenario splits the MLP in two stages"
    layers = list(mlp())
    part = nn.Sequential(*(layers[:2] if rank == 0 else layers[2:]))
    stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"))
    schedule_cls = getattr(pipelining, schedule)
    sched = schedule_cls(stage, PP_MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = make_optimizer(part.parameters(), "sgd")
    result: dict = {"losses": []}
    for step in range(STEPS):
        x, y = global_batch(step, world)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        if step == 0:
            result["grads"] = [p.grad.detach().clone() for p in part.parameters()]
        opt.step()
        opt.zero_grad()
        result["losses"].append([loss.item() for loss in losses])
    result["params"] = params_of(part)
    return result


SCENARIOS = {
    "ddp": _ddp,
    "ddp_bucket_view": lambda: _ddp("transformer", gradient_as_bucket_view=True),
    "ddp_no_sync": lambda: _ddp(micro=2),
    "fsdp2": _fsdp2,
    "tensor_parallel": _tensor_parallel,
    "pipeline_gpipe": lambda: _pipeline("ScheduleGPipe"),
    "pipeline_1f1b": lambda: _pipeline("Schedule1F1B"),
}
