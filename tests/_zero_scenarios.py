"""What each rank runs for tests/test_zero.py (one spawn per world size), and the
single-process references they are compared with."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dp_scenarios import batch, model
from _errors import error_message as _error
from torch import nn

from pycomm.parallel.models import lm_loss
from pycomm.parallel.zero import ZeroOptimizer, consolidate, load_sharded, save_sharded, shard_model

STEPS = 20
STAGES = (1, 2, 3)
# Stage 3 keeps the test model's biases and norms (< 200 elements) whole, and shards the
# rest in three units (the model's own, and one per block).
PERSIST_BELOW = 200
CLIP = 0.5  # small enough that clipping is active on most steps
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def reference(world: int, optim: str, clip: bool,
              world_from_10: int | None = None) -> dict[str, Any]:
    """One process on the concatenated batch, torch's optimizer and clipping; from step
    10 on, the batches of ``world_from_10`` ranks if given (a resharded resume)."""
    net = model()
    cls, kwargs = OPTIMIZERS[optim]
    opt = cls(net.parameters(), **kwargs)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world_from_10 if world_from_10 and step >= 10 else world)
        loss = lm_loss(net(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        losses.append(loss.item())
        opt.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "losses": losses,
            "norms": norms}


def reference_bf16(world: int, optim: str, reduce_dtype: torch.dtype | None) -> dict[str, Any]:
    """One process running ZeRO's bf16 recipe: the model computes in bf16, each of
    ``world`` replicas' rows is a backward of its own (bf16 gradients of its mean loss),
    their average is taken in ``reduce_dtype`` (bf16 by default) and cast to fp32, and
    the optimizer steps fp32 masters whose values the bf16 model then takes. What the
    sharded run does, rounding included, so the two may differ only by the order of
    additions in the reduction."""
    masters = list(model().parameters())
    net = model().to(torch.bfloat16)
    cls, kwargs = OPTIMIZERS[optim]
    opt = cls(masters, **kwargs)
    losses = []
    for step in range(STEPS):
        grads: list[list[torch.Tensor]] = []
        total = 0.0
        for rank in range(world):
            net.zero_grad()
            x, y = batch(step, world, rank)
            loss = lm_loss(net(x).float(), y)
            loss.backward()
            total += loss.item() / world
            grads.append([p.grad.float() for p in net.parameters()])
        for m, parts in zip(masters, zip(*grads, strict=True), strict=True):
            # pycomm reduces bf16 in fp32 and rounds the average once
            m.grad = (sum(parts) / world).to(reduce_dtype or torch.bfloat16).float()
        losses.append(total)
        opt.step()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters, strict=True):
                p.copy_(m)
    return {"losses": losses}


def build(group: Any, stage: int, optim: str, seed: int = 0, persist_below: int = PERSIST_BELOW,
          net: nn.Module | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """The test model (or ``net``) and a ZeroOptimizer of ``stage`` over ``group``."""
    net = model(seed=seed) if net is None else net
    if stage == 3:
        net = shard_model(net, group, persistence_threshold=persist_below)
    cls, kwargs = OPTIMIZERS[optim]
    opt = ZeroOptimizer(net.parameters(), cls, stage=stage, process_group=group,
                        bucket_cap_mb=16 / 1024, **kwargs)
    return net, opt


def full_params(net: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, in the unsharded model's order (stage 3 gathers them)."""
    if "zero3" not in net.__dict__:
        return [p.detach().clone() for p in net.parameters()]
    full = net.zero3.full_state_dict()
    return [full[name] for name, _ in model().named_parameters()]


def train(group: Any, stage: int, optim: str, clip: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # Different on purpose: ZeroOptimizer and shard_model keep rank 0's values.
    net, opt = build(group, stage, optim, seed=rank)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = lm_loss(net(x), y)
        loss.backward()
        if clip:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
        losses.append(loss.item())
        opt.step()
    out = {"params": full_params(net), "losses": losses, "norms": norms,
           "memory": opt.memory_stats(), "buckets": len(opt.layout.buckets)}
    if stage == 3:
        out["stats"] = dict(net.zero3.stats)
        out["units"] = [(u.persistent, len(u.names)) for u in net.zero3.units]
    return out


def memory(group: Any, stage: int) -> dict[str, Any]:
    """Measured bytes after one AdamW step, and Psi (stage 3: nothing kept whole)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    psi = sum(p.numel() for p in model().parameters())
    net, opt = build(group, stage, "adamw", persist_below=0)
    x, y = batch(0, world, rank)
    lm_loss(net(x), y).backward()
    opt.step()
    return {"psi": psi, **opt.memory_stats()}


def mixed(group: Any, stage: int, reduce_dtype: torch.dtype | None,
          persist_below: int = PERSIST_BELOW, root: str | None = None,
          optim: str = "adamw") -> dict[str, Any]:
    """bf16 compute and communication, fp32 masters: losses, bytes and dtypes; with
    ``root``, the fp32 masters at the end (through a checkpoint and ``consolidate``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net = model()
    if stage == 3:
        net = shard_model(net, group, persistence_threshold=persist_below)
    cls, kwargs = OPTIMIZERS[optim]
    opt = ZeroOptimizer(net.parameters(), cls, stage=stage, process_group=group,
                        bucket_cap_mb=16 / 1024, mixed_precision=torch.bfloat16,
                        reduce_dtype=reduce_dtype, **kwargs)
    losses, logits_dtype = [], None
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        logits = net(x)
        logits_dtype = str(logits.dtype)
        loss = lm_loss(logits.float(), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    state_dtypes = {str(t.dtype) for s in opt.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0}
    masters = None
    if root is not None:
        path = f"{root}/mixed-w{world}-s{stage}-{reduce_dtype}"
        save_sharded(path, net, opt)
        full = consolidate(path)
        masters = [full[name] for name, _ in model().named_parameters()]
    return {"losses": losses, "logits_dtype": logits_dtype, "state_dtypes": state_dtypes,
            "masters": masters,
            "master_dtypes": {str(p.dtype) for p in opt.shard_params},
            "psi": sum(p.numel() for p in model().parameters()), **opt.memory_stats()}


def memory_only(world: int) -> dict[Any, Any]:
    """The memory cases alone (the 4-rank job: the formulas at N = 4)."""
    out = {("pycomm", stage, "memory"): memory(dist.group.WORLD, stage) for stage in STAGES}
    for stage in STAGES:
        out[("pycomm", stage, "mixed_memory")] = mixed(dist.group.WORLD, stage, None, 0)
    return out



def bad_input(group: Any) -> dict[str, str]:
    from pycomm.parallel.models import GPT

    net = model()
    tied = model()
    tied.lm_head.weight = tied.embed.wte.weight  # shapes agree: vocab x n_embd
    sharded = shard_model(model(), group)
    return {
        "stage": _error(lambda: ZeroOptimizer(net.parameters(), torch.optim.SGD, stage=4,
                                              lr=0.1)),
        "twice": _error(lambda: ZeroOptimizer([*net.parameters(), next(net.parameters())],
                                              torch.optim.SGD, process_group=group, lr=0.1)),
        "stage3_plain": _error(lambda: ZeroOptimizer(net.parameters(), torch.optim.SGD,
                                                     stage=3, lr=0.1)),
        "stage1_sharded": _error(lambda: ZeroOptimizer(sharded.parameters(), torch.optim.SGD,
                                                       stage=1, lr=0.1)),
        # a tie is one unit's (both users inside it) or refused: here lm_head is a unit
        "tied": _error(lambda: shard_model(tied, group, persistence_threshold=1,
                                           unit_modules=[*tied.blocks, tied.lm_head])),
        "stray_unit": _error(lambda: shard_model(model(), group,
                                                 unit_modules=[GPT(model().cfg).lm_head])),
    }


def _steps(net: Any, opt: ZeroOptimizer, group: Any, steps: range) -> list[float]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.clip_grad_norm_(CLIP)
        losses.append(loss.item())
        opt.step()
    return losses


def checkpoints(group: Any, stage: int, root: str, load_from: str | None) -> dict[str, Any]:
    """Train 10 steps, save, train 10 more; a fresh model and optimizer loaded from the
    checkpoint (this job's, and ``load_from``'s: another world size) go on the same way."""
    world = dist.get_world_size(group)
    net, opt = build(group, stage, "adamw")
    first = _steps(net, opt, group, range(10))
    path = f"{root}/w{world}-s{stage}"
    save_sharded(path, net, opt)
    at_save = full_params(net)
    rest = _steps(net, opt, group, range(10, STEPS))
    resumed = {}
    for name, source in {"same": path, "other": load_from}.items():
        if source is None:
            continue
        fresh, fresh_opt = build(group, stage, "adamw", seed=7)
        load_sharded(source, fresh, fresh_opt)
        resumed[name] = _steps(fresh, fresh_opt, group, range(10, STEPS))
    try:
        from pycomm.parallel.models import GPT, GPTConfig

        other = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32))
        other, other_opt = build(group, stage, "adamw", net=other)
        load_sharded(path, other, other_opt)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"first": first, "rest": rest, "resumed": resumed, "at_save": at_save, "path": path,
            "other_model_error": error}


def run_all(world: int, root: str) -> dict[str, Any]:
    """Every case on the pycomm default group and on a gloo group of the same ranks."""
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out: dict[str, Any] = {}
    for name, group in groups.items():
        for stage in STAGES:  # gloo: the SGD case shows it runs there; the rest on pycomm
            out[(name, stage, "sgd")] = train(group, stage, "sgd", clip=False)
            if name == "pycomm":
                out[(name, stage, "adamw_clip")] = train(group, stage, "adamw", clip=True)
                out[(name, stage, "memory")] = memory(group, stage)
                out[(name, stage, "mixed_memory")] = mixed(group, stage, None, 0)
                out[(name, stage, "mixed_fp32_reduce")] = mixed(group, stage, torch.float32,
                                                                root=root, optim="sgd")
    out["bad_input"] = bad_input(dist.group.WORLD)
    for stage in STAGES:
        other = f"{root}/w2-s{stage}" if world == 3 else None  # saved by the 2-rank job
        out[("ckpt", stage)] = checkpoints(dist.group.WORLD, stage, root, other)
    return out
