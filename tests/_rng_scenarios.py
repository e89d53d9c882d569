"""The 4-rank job of tests/test_rng.py: 2 pipeline stages x TP 2, groups built by hand.

Ranks 0, 1 are stage 0 (TP group [0, 1]), ranks 2, 3 stage 1 (TP group [2, 3]); the
pipeline groups are [0, 2] and [1, 3]. Every recompute path must draw, in backward, the
dropout masks the forward drew, from every stream: its gradients are compared bit for
bit with the same layout run without recomputation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _errors import error_message
from torch import nn

from pycomm.parallel.models import GPT, GPTConfig, synthetic_batch
from pycomm.parallel.pipeline import Pipeline
from pycomm.parallel.recompute import (
    CheckpointArena,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_module,
)
from pycomm.parallel.rng import (
    REPLICATED,
    TENSOR_PARALLEL,
    TRACKER,
    model_parallel_seed,
    seed_from_mesh,
)
from pycomm.parallel.tensor import (
    apply_tensor_parallel,
    gather_tensor_parallel_state_dict,
    vocab_parallel_cross_entropy,
)

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.3)
ROWS, SEED = 8, 1234


class Head(nn.Module):
    """The GPT's final norm and LM head as one pipeline layer."""

    def __init__(self, gpt: Any):
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def groups() -> dict[str, Any]:
    """This rank's TP and pipeline groups, and its stage (every rank makes every group)."""
    rank = dist.get_rank()
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"tp": tps[rank // 2], "other_tp": tps[1 - rank // 2], "pp": pps[rank % 2],
            "stage": rank // 2}


def _tp_gpt(tp: Any, sequence_parallel: bool = False) -> Any:
    torch.manual_seed(0)
    return apply_tensor_parallel(GPT(CFG), tp, sequence_parallel=sequence_parallel)


def _seed(g: dict[str, Any]) -> None:
    model_parallel_seed(SEED, g["tp"], pp_rank=g["stage"])


def _draws() -> dict[str, torch.Tensor]:
    out = {"default": torch.rand(4)}
    for stream in (REPLICATED, TENSOR_PARALLEL):
        with TRACKER.fork(stream):
            out[stream] = torch.rand(4)
    return out


def seeding(g: dict[str, Any]) -> dict[str, Any]:
    """What each generator draws after seeding from the groups, from a DeviceMesh, and
    without a pipeline rank (today's call); the error for a group without this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    _seed(g)
    out: dict[str, Any] = {"groups": _draws()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))  # rank = 2 pp + tp
    seed_from_mesh(SEED, mesh)
    out["mesh"] = _draws()
    model_parallel_seed(SEED, g["tp"])
    out["no_pp"] = _draws()
    out["not_in_group"] = error_message(lambda: model_parallel_seed(SEED, g["other_tp"]))
    return out


def pipeline_step(g: dict[str, Any], mode: str, schedule: str,
                  blocks_checkpointed: bool = False) -> dict[str, Any]:
    """One Pipeline step of the TP GPT (dropout on every stream) with checkpoint ``mode``,
    its blocks also checkpointed one by one if ``blocks_checkpointed`` (nested)."""
    gpt = _tp_gpt(g["tp"])
    if blocks_checkpointed:
        for block in gpt.blocks:
            checkpoint_module(block, partition_group=g["tp"], arena=CheckpointArena())
    net = nn.Sequential(gpt.embed, *gpt.blocks, Head(gpt))
    pipe = Pipeline(net, [2, 2], chunks=4, checkpoint=mode, schedule=schedule,
                    process_group=g["pp"])
    x, y = synthetic_batch(CFG, ROWS, seed=3)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, g["tp"]).mean()

    _seed(g)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn)
    return {"loss": float(loss),
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}


def checkpointed_blocks(g: dict[str, Any], sequence_parallel: bool,
                        partition: bool | None) -> dict[str, Any]:
    """One step of the TP GPT, each block plain (None) or checkpointed by
    apply_activation_checkpointing, with (True) or without (False) P_a."""
    tp = g["tp"]
    net = _tp_gpt(tp, sequence_parallel)
    if partition is not None:
        apply_activation_checkpointing(net, "every", arena=CheckpointArena(),
                                       partition_group=tp if partition else None)
    x, y = synthetic_batch(CFG, ROWS, seed=3 + g["stage"])
    _seed(g)
    loss = vocab_parallel_cross_entropy(net(x), y, tp).mean()
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": gather_tensor_parallel_state_dict(net, grads=True)}


def partition_with_sequence_parallel(g: dict[str, Any]) -> str:
    """P_a on a sequence-parallel model: the error it is refused with, else (today's
    defect) how far its gradients are from plain checkpointing."""
    message = error_message(lambda: checkpointed_blocks(g, True, True))
    if message:
        return message
    wrong = checkpointed_blocks(g, True, True)["grads"]
    right = checkpointed_blocks(g, True, False)["grads"]
    diff = max((wrong[k] - right[k]).abs().max().item() for k in right)
    return f"no error; gradients off by {diff:.3g}"


def partition_of_a_sequence_parallel_block(g: dict[str, Any]) -> str:
    """checkpoint_module(block, partition_group=tp) of a sequence-parallel block."""
    block = _tp_gpt(g["tp"], sequence_parallel=True).blocks[0]
    return error_message(lambda: checkpoint_module(block, partition_group=g["tp"]))


def partition_of_differing_inputs(g: dict[str, Any]) -> str:
    """A direct checkpoint(..., partition_group=tp) of inputs that differ across the TP
    ranks (as sequence shards do): the error, or how far the input gradient is off."""
    tp = g["tp"]
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def grad(group: Any) -> torch.Tensor:
        xi = x.clone().requires_grad_(True)
        checkpoint(lambda t: layer(t).tanh(), xi, partition_group=group).sum().backward()
        return xi.grad

    message = error_message(lambda: grad(tp))
    if message:
        return message
    return f"no error; input gradient off by {(grad(tp) - grad(None)).abs().max().item():.3g}"


def run_all(world: int) -> dict[Any, Any]:
    g = groups()
    out: dict[Any, Any] = {"stage": g["stage"], "seeding": seeding(g)}
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "always", "except_last"):
            out[("pipeline", schedule, mode)] = pipeline_step(g, mode, schedule)
    out[("pipeline", "nested")] = pipeline_step(g, "except_last", "1f1b", True)
    for sp in (False, True):
        for partition in (None, False) if sp else (None, False, True):
            out[("blocks", sp, partition)] = checkpointed_blocks(g, sp, partition)
    out["pa_sp"] = partition_with_sequence_parallel(g)
    out["pa_sp_block"] = partition_of_a_sequence_parallel_block(g)
    out["pa_differing"] = partition_of_differing_inputs(g)
    return out
