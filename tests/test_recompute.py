"""pycomm.parallel.recompute: checkpointed blocks against plain ones (dropout on), the arena,
and P_a over a TP = 2 group (one spawn)."""

import pytest
import torch

from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
from pycomm.parallel.pipeline import ActivationMeter
from pycomm.parallel.recompute import CheckpointArena, apply_activation_checkpointing, checkpoint

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.2)


def _step(policy, arena=None):
    torch.manual_seed(0)
    net = GPT(CFG)
    net.train()
    wrapped = apply_activation_checkpointing(net, policy, arena=arena) if policy else []
    x, y = synthetic_batch(CFG, 4, seed=1)
    meter = ActivationMeter()
    torch.manual_seed(5)  # the same dropout draws in every run
    with meter.measure(net):
        loss = lm_loss(net(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    return loss.item(), grads, meter.peak_bytes, len(wrapped)


@pytest.fixture(scope="module")
def plain():
    return _step(None)


@pytest.mark.parametrize("policy", ["every", 2, torch.nn.LayerNorm,
                                    lambda name, m: name.endswith("mlp")])
def test_checkpointed_blocks_give_identical_gradients_with_dropout(plain, policy):
    loss, grads, saved, wrapped = _step(policy)
    assert wrapped > 0
    assert loss == plain[0]
    for name, grad in plain[1].items():
        assert torch.equal(grads[name], grad), name
    assert saved < plain[2]


def test_every_block_keeps_a_fraction_of_the_activations(plain):
    every, half = _step("every"), _step(2)
    assert every[2] < half[2] < plain[2]
    assert every[3] == CFG.n_layer and half[3] == CFG.n_layer // 2


def test_the_arena_grows_once_then_is_reused():
    arena = CheckpointArena()
    _step("every", arena)
    first = arena.stats()
    _step("every", arena)
    second = arena.stats()
    assert first["overflows"] == CFG.n_layer and second["overflows"] == CFG.n_layer
    block_input = 4 * CFG.block_size * CFG.n_embd * 4
    assert second["reserved_bytes"] == CFG.n_layer * block_input
    assert second["live_bytes"] == 0


def test_multiple_outputs_and_plain_arguments():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)

    def fn(a, scale):
        h = a @ w
        return h * scale, h.relu()

    out = checkpoint(fn, x, 2.0)
    (out[0].sum() + out[1].sum()).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = fn(x, 2.0)
    (ref[0].sum() + ref[1].sum()).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_bad_policies_are_refused():
    net = GPT(CFG)
    with pytest.raises(ValueError, match="unknown policy 'some'"):
        apply_activation_checkpointing(net, "some")
    with pytest.raises(ValueError, match="k >= 1"):
        apply_activation_checkpointing(net, 0)


@pytest.fixture(scope="module")
def tp2(require_pycomm):
    from _recompute_scenarios import run_all

    from pycomm.testing import run_ranks

    return run_ranks(run_all, 2, 2, timeout_s=300.0)


def test_partitioned_activations_give_the_same_gradients_with_half_the_bytes(tp2):
    from _recompute_scenarios import CFG as TP_CFG
    from _recompute_scenarios import ROWS

    for r in tp2:
        for mode in (False, True):
            for name, grad in r[None]["grads"].items():
                torch.testing.assert_close(r[mode]["grads"][name], grad, rtol=1e-5, atol=1e-7)
        block_input = ROWS * TP_CFG.block_size * TP_CFG.n_embd * 4
        assert r[False]["arena_peak"] == TP_CFG.n_layer * block_input
        assert r[True]["arena_peak"] == TP_CFG.n_layer * block_input // 2  # 1/TP each
