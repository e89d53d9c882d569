"""The fused recompute ops against the unfused PyTorch composition."""

import pytest
import torch
import torch.nn.functional as F

from pycomm.parallel.recompute import fused_bias_dropout_add, fused_bias_gelu

SHAPES = [(3, 5), (2, 7, 33), (1, 1), (4, 64, 1536)]  # odd sizes; the last uses threads


def _inputs(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    b = torch.randn(shape[-1], generator=gen).to(dtype).requires_grad_(True)
    return x, b


@pytest.mark.precision  # torch's vectorised erf differs per ATEN_CPU_CAPABILITY
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_gelu_of_the_sum_forward_and_backward(shape):
    x, b = _inputs(shape)
    g = torch.randn(shape)
    out = fused_bias_gelu(x, b)
    out.backward(g)
    gx, gb = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    ref = F.gelu(x + b)
    ref.backward(g)
    # atol: a few float32 ulps of O(1) values (libm's erf and torch's vectorised erf
    # round differently where gelu crosses zero)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.precision
def test_bias_gelu_in_bfloat16_is_within_its_rounding():
    x, b = _inputs((8, 129), torch.bfloat16)
    out = fused_bias_gelu(x, b)
    ref = F.gelu(x.float() + b.float())  # the fused op adds in float, rounding once
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("shape", SHAPES)
def test_bias_dropout_add_without_dropout_is_the_sum(shape):
    x, b = _inputs(shape)
    r = torch.randn(shape, requires_grad=True)
    for p, training in ((0.0, True), (0.4, False)):
        out = fused_bias_dropout_add(x, b, r, p, training)
        torch.testing.assert_close(out, x + b + r, rtol=1e-6, atol=1e-6)


def test_bias_dropout_add_drops_a_p_share_and_scales_the_rest():
    shape, p = (64, 1000), 0.3
    x, b = _inputs(shape)
    r = torch.randn(shape, requires_grad=True)
    torch.manual_seed(7)
    out = fused_bias_dropout_add(x, b, r, p, True)
    kept = (x + b) / (1 - p) + r
    is_kept = torch.isclose(out, kept, rtol=1e-5, atol=1e-6)
    is_dropped = torch.isclose(out, r, rtol=0, atol=0)
    assert bool((is_kept | is_dropped).all())
    assert abs(float(is_dropped.float().mean()) - p) < 0.01
    # backward: the same mask from the seed; the residual's gradient is the gradient
    g = torch.randn(shape)
    out.backward(g)
    torch.testing.assert_close(x.grad, torch.where(is_dropped, 0.0, g / (1 - p)))
    torch.testing.assert_close(b.grad, x.grad.sum(0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(r.grad, g)
    # the same generator state gives the same mask (what checkpointing relies on)
    torch.manual_seed(7)
    again = fused_bias_dropout_add(x, b, r, p, True)
    assert torch.equal(again, out)


def test_bad_inputs_are_named():
    x, b = _inputs((4, 6))
    with pytest.raises(ValueError, match=r"bias of shape \[5\] does not match"):
        fused_bias_gelu(x, torch.zeros(5))
    with pytest.raises(ValueError, match="float32 or bfloat16 only"):
        fused_bias_gelu(x.double(), b.double())
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
        fused_bias_dropout_add(x, b, torch.zeros(4, 6), 1.5, True)
    with pytest.raises(ValueError, match="the residual is"):
        fused_bias_dropout_add(x, b, torch.zeros(4, 5), 0.1, True)


def _gpt_step(fused, dropout):
    from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
    from pycomm.parallel.pipeline import ActivationMeter
    from pycomm.parallel.recompute import apply_fused_kernels

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32,
                    dropout=dropout)
    torch.manual_seed(0)
    net = GPT(cfg)
    if fused:
        assert len(apply_fused_kernels(net)) == cfg.n_layer
    x, y = synthetic_batch(cfg, 4, seed=1)
    meter = ActivationMeter()
    with meter.measure(net):
        loss = lm_loss(net(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters()}, meter.peak_bytes


def test_fused_gpt_blocks_match_the_plain_ones_and_keep_no_dropout_masks():
    plain, fused = _gpt_step(False, 0.0), _gpt_step(True, 0.0)
    assert fused[0] == pytest.approx(plain[0], rel=1e-6)
    for name, grad in plain[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-6)
    # with dropout the unfused MLP keeps a mask per block; the fused one a seed
    plain_d, fused_d = _gpt_step(False, 0.1), _gpt_step(True, 0.1)
    assert fused_d[2] < plain_d[2]


def test_fused_blocks_refuse_models_without_such_blocks():
    from pycomm.parallel.recompute import apply_fused_kernels

    with pytest.raises(ValueError, match="no block with ln_1, attn, ln_2"):
        apply_fused_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2)))
