"""The project GPT with experts (``GPTConfig(moe_experts=E)``): its sparse block computes
what HuggingFace Mixtral's does from the same weights, ``forward_with_aux`` returns
transformers' ``load_balancing_loss_func`` of its routers, the config and the trainer's
flags are checked eagerly, its plan names the experts and routers, and the dense GPT is
the one it was. Layouts against one process: ``tests/test_moe.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pycomm.parallel.models import GPT, GPTConfig
from pycomm.parallel.models.gpt_moe import SparseMoE, load_balancing_loss, router_logits

SMALL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def moe_gpt(**kw: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL, **{"moe_experts": 4, "moe_top_k": 2, **kw}))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, 9:], mask[2, :5] = 0, 0
    return tokens, mask


def test_the_dense_gpt_keeps_its_parameters_and_has_no_aux_loss():
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**SMALL))
    names = [n for n, _ in dense.named_parameters()]
    assert [n for n in names if n.startswith("blocks.0.mlp")] == [
        "blocks.0.mlp.c_fc.weight", "blocks.0.mlp.c_fc.bias", "blocks.0.mlp.c_proj.weight",
        "blocks.0.mlp.c_proj.bias"]
    tokens, mask = padded_batch()
    logits, aux = dense.forward_with_aux(tokens, attention_mask=mask)
    assert torch.equal(logits, dense(tokens, attention_mask=mask)) and float(aux) == 0.0
    plan = dense.parallel_plan()
    assert plan.experts is None and plan.balance is None and "blocks.*.mlp.c_fc" in plan.tp


def test_the_sparse_block_is_mixtrals_from_the_same_weights():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    ours = moe_gpt(moe_intermediate=48).blocks[0].mlp
    assert isinstance(ours, SparseMoE)
    theirs = mixtral.MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(2))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(a).square().sum().backward()
    theirs(b).square().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, dict(theirs.named_parameters())[name].grad)


@pytest.mark.parametrize("masked", [False, True])
def test_forward_with_aux_is_transformers_load_balancing_loss(masked):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    model = moe_gpt()
    tokens, mask = padded_batch()
    given = mask if masked else None
    with router_logits(model) as logits:
        model(tokens, attention_mask=given)
    want = mixtral.load_balancing_loss_func(tuple(logits), 4, 2, given)
    _, aux = model.forward_with_aux(tokens, attention_mask=given)
    assert len(logits) == 2 and 1.0 < aux.item() < 4.0
    torch.testing.assert_close(aux, want)
    torch.testing.assert_close(load_balancing_loss(logits, 4, 2, given), want)
    aux.backward()
    assert all(b.mlp.gate.weight.grad.abs().sum() > 0 for b in model.blocks)


def test_one_process_objective_is_cross_entropy_plus_coef_times_aux():
    model = moe_gpt(moe_aux_coef=0.02)
    tokens, mask = padded_batch()
    logits, aux = model.forward_with_aux(tokens, attention_mask=mask)
    loss = F.cross_entropy(logits.reshape(-1, 64), tokens.reshape(-1)) + 0.02 * aux
    loss.backward()
    experts = model.blocks[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None


@pytest.mark.parametrize("kw, message", [
    ({"moe_experts": -1}, "moe_experts=-1 must be >= 0"),
    ({"moe_experts": 2, "moe_top_k": 3}, "moe_top_k=3 must be in 1 .. moe_experts=2"),
    ({"moe_experts": 4, "moe_top_k": 0}, "moe_top_k=0 must be in 1 .. moe_experts=4"),
    ({"moe_experts": 4, "moe_aux_coef": -0.1}, "moe_aux_coef=-0.1 must be >= 0"),
    ({"moe_experts": 4, "moe_intermediate": 0}, "moe_intermediate=0 must be >= 1"),
])
def test_a_config_the_experts_cannot_have_is_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kw)


def test_the_plan_names_the_experts_and_their_load_balance():
    plan = moe_gpt(moe_aux_coef=0.02).parallel_plan()
    assert plan.experts == "blocks.*.mlp.experts"
    assert plan.tp["blocks.*.mlp.experts"] == "moe_tp_experts"
    assert plan.tp["blocks.*.mlp.gate"] == "replicated" and "blocks.*.mlp.c_fc" not in plan.tp
    b = plan.balance
    assert b is not None and (b.routers, b.experts, b.top_k, b.coef) == (
        "blocks.*.mlp.gate", 4, 2, 0.02)
    assert moe_gpt(moe_aux_coef=0.0).parallel_plan().balance is None


def test_a_model_built_on_meta_is_initialised_by_its_plan():
    with torch.device("meta"):
        model = GPT(GPTConfig(**SMALL, moe_experts=4))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for path, module in model.named_modules():
        model.parallel_plan().init(path, module)
    moe = model.blocks[0].mlp
    std = {n: p.detach().std().item() for n, p in moe.named_parameters()}
    assert 0.015 < std["gate.weight"] < 0.025 and 0.015 < std["experts.gate_up_proj"] < 0.025
    assert 0.007 < std["experts.down_proj"] < 0.013  # 0.02 / sqrt(2 n_layer)


@pytest.mark.parametrize("flags, message", [
    (["--model", "llama", "--moe-experts", "4"], "--moe-experts gives the project's GPT"),
    (["--moe-top-k", "1"], "--moe-top-k given without --moe-experts"),
    (["--moe-aux-coef", "0.1"], "--moe-aux-coef given without --moe-experts"),
    (["--dp", "2", "--ep", "2"], "--ep 2 splits a mixture of experts"),
    (["--moe-experts", "2", "--moe-top-k", "3"], "moe_top_k=3 must be in 1 .. moe_experts=2"),
    (["--moe-experts", "4", "--plan", "auto"], "--plan auto times a dense GPT"),
    (["--moe-experts", "4", "--pp", "2"], "1f1b schedule .* give --schedule gpipe"),
])
def test_the_trainers_expert_flags_are_checked_before_any_rank_starts(flags, message):
    from pycomm.parallel.job.config import parse

    with pytest.raises(ValueError, match=message):
        parse(flags)
