"""What each rank runs for tests/test_zero_memory.py: a ~1M-parameter GPT trained by
data parallelism or ZeRO 1-3, and the bytes it holds, measured from outside the
optimizer (bench._memory_probe: storages reachable, torch's allocations over a step).

A step is what a composed job does: ``zero_grad()``, two backwards (a pipeline's
micro-batches accumulate), ``reduce_gradients()`` when reducing after backward, the step.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

from bench._memory_probe import PeakSampler, held_bytes, in_use
from pycomm.parallel.data import DataParallel
from pycomm.parallel.models import GPT, GPTConfig, lm_loss
from pycomm.parallel.zero import ZeroOptimizer, shard_model

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=5, n_head=4, n_embd=128)
# One parameter (the tied embedding and head) is ~95% of this one: no bucket cap splits
# it, so stage 2 keeps its gradient whole, as stage 1 does.
LOPSIDED = GPTConfig(vocab_size=8192, block_size=16, n_layer=1, n_head=2, n_embd=64,
                     tie_embeddings=True)
MODELS = {"gpt": CFG, "lopsided": LOPSIDED}
MICRO, ROWS = 2, 2  # backwards per step; rows per rank and backward
# One bucket larger than the model, and a cap smaller than its largest parameters (the
# 128 x 512 MLP weights, 256 KiB): every bucket one parameter or a few small ones.
CAPS_MB = (25.0, 0.2)


def _model(name: str = "gpt") -> GPT:
    torch.manual_seed(0)
    return GPT(MODELS[name])


def psi(name: str = "gpt") -> int:
    return sum(p.numel() for p in _model(name).parameters())


def _build(stage: int, in_backward: bool, cap_mb: float,
           name: str) -> tuple[Any, torch.optim.Optimizer]:
    net: Any = _model(name)
    if stage == 0:
        net = DataParallel(net, bucket_cap_mb=cap_mb)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)
    if stage == 3:
        shard_model(net, dist.group.WORLD, unit_modules=list(net.blocks), persistence_threshold=0)
    opt = ZeroOptimizer(net.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=cap_mb,
                        reduce_in_backward=in_backward, lr=1e-3)
    return net, opt


def _step(net: Any, opt: Any, step: int, in_backward: bool) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    opt.zero_grad(set_to_none=True)
    cfg: Any = net.module.cfg if isinstance(net, DataParallel) else net.cfg
    for _ in range(MICRO):
        x = torch.randint(0, cfg.vocab_size, (ROWS, cfg.block_size), generator=gen)
        (lm_loss(net(x), x) / MICRO).backward()
    if not in_backward:
        opt.reduce_gradients()
    opt.step()


def measure(stage: int, in_backward: bool, cap_mb: float, name: str = "gpt") -> dict[str, Any]:
    """After a first step (Adam's state appears): the bytes held after a second step,
    by role (storages reachable from the model and optimizer), and the process's bytes
    in use at the peak of that step and after it, above what it used before building."""
    torch.set_num_threads(1)
    dist.barrier()  # pycomm drops the previous case's finished ops' tensors at an op
    gc.collect()
    base = in_use()
    net, opt = _build(stage, in_backward, cap_mb, name)
    _step(net, opt, 0, in_backward)
    with PeakSampler() as sampler:
        _step(net, opt, 1, in_backward)
    layout: Any = getattr(opt, "layout", None)
    buckets = [b.shard * layout.world * 4 for b in layout.buckets] if stage in (1, 2) else []
    units = [sum(p.numel() for p in block.parameters()) for block in _model(name).blocks]
    return {"psi": psi(name), "world": dist.get_world_size(), "steady": held_bytes(net, opt),
            "peak": sampler.peak - base, "after": sampler.after - base,
            "bucket_bytes": buckets, "unit_numel": max(units)}


def trained(stage: int, in_backward: bool, cap_mb: float, backend: str) -> torch.Tensor:
    """Every parameter after three steps of two backwards each (``gloo``: the reduction
    is a sum, averaged after), flat. SGD: linear in the gradient, so summation order
    shows as rounding, not amplified as Adam's normalisation does near zero."""
    group = dist.new_group(backend="gloo") if backend == "gloo" else dist.group.WORLD
    net = _model()
    opt = ZeroOptimizer(net.parameters(), torch.optim.SGD, stage=stage, process_group=group,
                        bucket_cap_mb=cap_mb, reduce_in_backward=in_backward, lr=0.1,
                        momentum=0.9)
    for step in range(3):
        _step(net, opt, step, in_backward)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
