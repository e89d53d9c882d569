"""What each rank runs for tests/test_tensor_parallel.py (one spawn per TP size), and the
single-process references they are compared with."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _errors import error_message
from torch import nn

from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
from pycomm.parallel.recompute import checkpoint
from pycomm.parallel.tensor import (
    TRACKER,
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
    count_comms,
    gather_tensor_parallel_state_dict,
    model_parallel_seed,
    vocab_parallel_cross_entropy,
)
from pycomm.parallel.tensor import comms as tp_comms
from pycomm.parallel.tensor.random import REPLICATED, TENSOR_PARALLEL

# Every size divisible by 2, 3 and 4: heads, hidden, 3 x hidden, 4 x hidden, vocabulary
# and sequence (sequence parallelism splits it).
CFG = GPTConfig(vocab_size=96, block_size=12, n_layer=2, n_head=12, n_embd=48)
ROWS = 4
SGD_STEPS = 10
LR = 0.1


def model(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    cfg = CFG if dropout == 0 else GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    return GPT(cfg)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(CFG, ROWS, seed=50 + step)


def reference() -> dict[str, Any]:
    """The unsharded model: logits, loss and gradients of step 0, parameters after the
    SGD steps."""
    net = model()
    x, y = batch(0)
    logits = net(x)
    loss = lm_loss(logits, y)
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.item(),
           "grads": {n: p.grad.clone() for n, p in net.named_parameters()}}
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    opt.step()
    for step in range(1, SGD_STEPS):
        opt.zero_grad()
        x, y = batch(step)
        lm_loss(net(x), y).backward()
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _tp_loss(net: nn.Module, group: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    logits = net(x)
    return logits, vocab_parallel_cross_entropy(logits, y, group).mean()


def numerics(group: Any, sp: bool) -> dict[str, Any]:
    """Step 0's logits, loss and gradients, then the parameters after SGD steps."""
    net = apply_tensor_parallel(model(), group, sequence_parallel=sp)
    initial = gather_tensor_parallel_state_dict(net)
    with count_comms() as counts:
        logits, loss = _tp_loss(net, group, 0)
        loss.backward()
    out = {"logits": tp_comms.gather_last(logits.detach(), group), "loss": loss.item(),
           "grads": gather_tensor_parallel_state_dict(net, grads=True), "initial": initial,
           "counts": dict(counts)}
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    opt.step()
    for step in range(1, SGD_STEPS):
        opt.zero_grad()
        _tp_loss(net, group, step)[1].backward()
        opt.step()
    out["params"] = gather_tensor_parallel_state_dict(net)
    out["local_param_numel"] = {n: p.numel() for n, p in net.named_parameters()}
    return out


def block_counts(group: Any, sp: bool) -> dict[str, dict[str, int]]:
    """Collectives of one attention and one MLP of the converted model, forward and
    backward, on their own."""
    out = {}
    net = apply_tensor_parallel(model(), group, sequence_parallel=sp)
    for name in ("attn", "mlp"):
        layer = getattr(net.blocks[0], name)
        x = torch.randn(ROWS, CFG.block_size, CFG.n_embd)
        if sp:
            x = tp_comms.split_dim(x, 1, group)
        x.requires_grad_(True)
        with count_comms() as counts:
            layer(x).sum().backward()
        out[name] = dict(counts)
    return out


def saved_activation_bytes(group: Any, recompute: bool) -> int:
    """Bytes autograd keeps from one forward with sequence parallelism."""
    net = apply_tensor_parallel(model(), group, sequence_parallel=True,
                                recompute_gather=recompute)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _tp_loss(net, group, 0)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def linear_pair(group: Any) -> dict[str, Any]:
    """A column-parallel linear gathering its output, then a row-parallel one splitting
    its input, against the dense pair."""
    torch.manual_seed(3)
    first, second = nn.Linear(8, 12 * 4), nn.Linear(12 * 4, 6)
    x = torch.randn(5, 8, requires_grad=True)
    dense_out = second(first(x))
    dense_out.sum().backward()
    dense_grad = x.grad.clone()
    x.grad = None
    col = ColumnParallelLinear.from_dense(first, group, gather_output=True)
    row = RowParallelLinear.from_dense(second, group, input_is_parallel=False)
    out = row(col(x))
    out.sum().backward()
    return {"out": out.detach(), "dense_out": dense_out.detach(), "grad": x.grad.clone(),
            "dense_grad": dense_grad}


def rng(group: Any) -> dict[str, Any]:
    """What the dropout streams give on each rank, and a checkpointed block's replay."""
    model_parallel_seed(1234, group)
    draws = {}
    for stream in (REPLICATED, TENSOR_PARALLEL):
        with TRACKER.fork(stream):
            draws[stream] = torch.rand(4)
    net = apply_tensor_parallel(model(dropout=0.2), group, sequence_parallel=False)
    net.train()
    hidden = []  # the last block's output: whole on every rank without SP
    net.ln_f.register_forward_hook(lambda _m, args, _o: hidden.append(args[0].detach()))
    _tp_loss(net, group, 0)
    net.eval()
    _tp_loss(net, group, 0)
    # The same block with and without recomputation, from the same stream states.
    block = net.blocks[0]
    x = torch.randn(ROWS, CFG.block_size, CFG.n_embd)
    grads = []
    snap = TRACKER.snapshot()
    for use_checkpoint in (False, True):
        TRACKER.restore(snap)
        xi = x.clone().requires_grad_(True)
        out = checkpoint(block, xi) if use_checkpoint else block(xi)
        out.square().sum().backward()
        grads.append(xi.grad.clone())
    return {"draws": draws, "hidden": hidden[0], "hidden_eval": hidden[1],
            "replay_equal": torch.equal(grads[0], grads[1])}


def _error(call: Any) -> str:
    return error_message(call, (ValueError, TypeError, KeyError))


def _draw_on_an_unseeded_stream() -> None:
    with TRACKER.fork("nope"):
        torch.rand(1)


def bad_input(group: Any) -> dict[str, str]:
    odd_heads = GPT(GPTConfig(vocab_size=96, block_size=12, n_layer=1, n_head=5, n_embd=40))
    odd_vocab = GPT(GPTConfig(vocab_size=97, block_size=12, n_layer=1, n_head=12, n_embd=48))
    sp = apply_tensor_parallel(model(), group, sequence_parallel=True)
    tokens = torch.randint(0, 96, (2, 7))  # 7 tokens: not divisible by 2, 3 or 4
    return {
        "heads": _error(lambda: apply_tensor_parallel(odd_heads, group)),
        "vocab": _error(lambda: apply_tensor_parallel(odd_vocab, group)),
        "sequence": _error(lambda: sp(tokens)),
        "not_gpt": _error(lambda: apply_tensor_parallel(nn.Linear(2, 2), group)),
        "unseeded": _error(_draw_on_an_unseeded_stream),
    }


def _loss_and_grad_norm(net: nn.Module, b: Any, logits_of: Any, names: list[str],
                        tp: bool) -> tuple[float, float]:
    """The loss and the norm of the gradients of ``names`` (the one-process model's
    parameters, each tie once)."""
    import torch.nn.functional as F

    logits = logits_of(net, b)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.targets.reshape(-1),
                           ignore_index=-100)
    loss.backward()
    grads = (gather_tensor_parallel_state_dict(net, grads=True) if tp
             else {n: p.grad for n, p in net.named_parameters()})
    return loss.item(), torch.cat([grads[n].reshape(-1) for n in names]).norm().item()


def other_models(group: Any) -> dict[tuple[str, str, bool], Any]:
    """The same conversion on a GPT with tied embeddings and on HuggingFace's Llama (its
    plan derived by ``plan_for``), on real batches (ignored labels in uneven counts, left
    padding, packed documents): (loss, gradient norm) of TP and of one process built
    from the same weights."""
    import _real_batch_scenarios as rb

    from pycomm.parallel.compose import plan_for

    def tied_gpt() -> nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=rb.VOCAB, block_size=rb.SEQ, n_layer=2, n_head=4,
                             n_embd=32, tie_embeddings=True))

    builds = {"gpt_tied": tied_gpt, "llama": lambda: rb.build("llama")}
    out: dict[tuple[str, str, bool], Any] = {}
    for name, build in builds.items():
        for case in ("ignored", "left_pad", "packed"):
            if name == "llama" and case == "packed":
                continue  # HF's sdpa Llama attends across packed documents: not the case
            b, one = rb.batch(case, 1), build()
            names = [n for n, _ in one.named_parameters()]
            single = _loss_and_grad_norm(one, b, rb._logits, names, tp=False)
            for sp in (False, True):
                dense = build()
                net = apply_tensor_parallel(dense, group, sequence_parallel=sp,
                                            parallel_output=False, plan=plan_for(dense))
                tied = name == "gpt_tied" and net.lm_head.weight is net.embed.wte.weight
                out[(name, case, sp)] = {"single": single, "tied": tied,
                                         "tp": _loss_and_grad_norm(net, b, rb._logits, names,
                                                                   tp=True)}
    return out


def run_all(world: int) -> dict[Any, Any]:
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out: dict[Any, Any] = {}
    for name, group in groups.items():
        for sp in (False, True):
            out[(name, sp, "numerics")] = numerics(group, sp)
    group = groups["pycomm"]
    for sp in (False, True):
        out[(sp, "blocks")] = block_counts(group, sp)
    out["saved"] = {r: saved_activation_bytes(group, r) for r in (True, False)}
    out["pair"] = linear_pair(group)
    out["rng"] = rng(group)
    out["bad"] = bad_input(group)
    if world == 2:  # Llama's 2 key-value heads and the 16-token sequence split by 2 only
        out["other_models"] = other_models(group)
    return out
