"""The two tensor-parallel wrappings ``bench.training tensor`` compares, on one GPT.

torch's DTensor plan is the one torch's TP tutorial gives a transformer:
``ColwiseParallel`` for the first linear of attention and MLP, ``RowwiseParallel`` for
the second, the embedding row-wise (vocabulary split), the head column-wise with
replicated output; with sequence parallelism ``SequenceParallel`` norms and the
activations between layers split along the sequence. Two changes make it exact for the
reference GPT: the fused QKV weight's rows are reordered so each rank's contiguous
shard holds whole heads of Q, K and V, and attention is told its local head count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pycomm.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy


def _heads_per_rank(net: Any, tp: int) -> None:
    with torch.no_grad():
        for block in net.blocks:
            attn = block.attn
            rows = attn.c_attn.weight.shape[0] // 3
            order = torch.arange(3 * rows).view(3, tp, rows // tp).transpose(0, 1).reshape(-1)
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
            attn.n_head //= tp


def dtensor_tp(net: nn.Module, group: dist.ProcessGroup | None, sp: bool) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    gpt: Any = net
    _heads_per_rank(gpt, mesh.size())
    between = Shard(1) if sp else Replicate()  # activations between the layers
    plan: dict[str, Any] = {
        "embed.wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sp:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=between)
        plan["ln_f"] = SequenceParallel()
    parallelize_module(gpt, mesh, plan)
    for block in gpt.blocks:
        block_plan: dict[str, Any] = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=between),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=between),
        }
        if sp:
            gather = PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate())
            block_plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                               "attn": gather, "mlp": gather})
        parallelize_module(block, mesh, block_plan)
    return net


def parallel_tp(net: nn.Module, group: dist.ProcessGroup | None, sp: bool) -> nn.Module:
    """``pycomm.parallel.tensor``; the loss is the vocab-parallel one (no logits gather)."""
    apply_tensor_parallel(net, group, sequence_parallel=sp)
    net.__dict__["loss_fn"] = lambda logits, y: vocab_parallel_cross_entropy(logits, y,
                                                                             group).mean()
    return net


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's local shard)."""
    to_local = getattr(p, "to_local", None)
    return int(to_local().numel()) if to_local is not None else p.numel()
