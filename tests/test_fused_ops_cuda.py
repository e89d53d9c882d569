"""The fused recompute ops on CUDA against the CPU: the same values, the same masks.

Needs a GPU and a CUDA build of pycomm._C (``fused_*_cuda``); skipped without a GPU, or
without nvcc to build one (a pycomm._C that does not load fails them). The
float32 references are torch's CPU ops; the dropout masks must equal the CPU kernels'
bit for bit (one splitmix64 hash of (seed, element index) on both devices).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pycomm.parallel.recompute import fused_bias_dropout_add, fused_bias_gelu


def _cuda_missing() -> str | None:
    """A named missing resource, or None (then the tests run, and fail if the build is bad)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from pycomm._extension import extension_error
    from pycomm._extension import load as _extension

    if extension_error() is not None:
        return None  # require_pycomm fails every test, saying why
    if hasattr(_extension(), "fused_bias_gelu_cuda"):
        return None
    from torch.utils import cpp_extension

    if shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
        return "no nvcc: pycomm._C was built without CUDA (no fused_bias_gelu_cuda)"
    return None  # nvcc is here, so a CPU-only pycomm._C is a build to fix: the tests fail


REASON = _cuda_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_pycomm"),
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]

# odd sizes: rows shorter than a 16-byte pack, columns not a multiple of one (4 float32,
# 8 bfloat16), a tail after the last pack, one long row, and the bench's MLP shape
SHAPES = [(1, 1), (3, 5), (1000, 3), (5, 12), (2, 7, 33), (7, 1023), (2**20 + 3,),
          (4, 64, 1536)]
# float32 against float32: GPU erff/expf and torch's CPU erf/exp, a few ulp apart
F32 = {"rtol": 1e-5, "atol": 4e-6}
# one rounding to the 16-bit type (half an ulp: 2^-8 relative in bfloat16, 2^-11 in
# float16) on top of float32 results a few float ulp apart
ROUNDING = {torch.bfloat16: {"rtol": 2**-8 * 1.01, "atol": 1e-5},
            torch.float16: {"rtol": 2**-11 * 1.01, "atol": 1e-5}}


def _inputs(shape, dtype=torch.float32, seed=0, offset=0):
    """x, bias, residual and a gradient on the CPU (dtype), and CUDA copies of them; with
    ``offset`` the CUDA x, residual and gradient are views `offset` elements into a buffer,
    so not 16-byte aligned (the kernels' scalar path)."""
    gen = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(shape, generator=gen).to(dtype), torch.randn(shape[-1], generator=gen)
           .to(dtype), torch.randn(shape, generator=gen).to(dtype),
           torch.randn(shape, generator=gen).to(dtype)]

    def to_cuda(t, shift):
        if not shift:
            return t.cuda()
        buf = torch.empty(t.numel() + shift, dtype=dtype, device="cuda")
        buf[shift:].copy_(t.reshape(-1))
        return buf[shift:].view(t.shape)

    gpu = [to_cuda(t, 0 if i == 1 else offset) for i, t in enumerate(cpu)]
    return cpu, gpu


def _leaf(t):
    """A leaf requiring grad over t's memory (an unaligned view stays unaligned)."""
    return t.detach().requires_grad_(True)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_on_cuda_matches_torch_on_cpu_forward_and_backward(shape, offset):
    (x, b, _, g), (xc, bc, _, gc) = _inputs(shape, offset=offset)
    xc, bc = _leaf(xc), _leaf(bc)
    out = fused_bias_gelu(xc, bc)
    out.backward(gc)
    x, b = x.requires_grad_(True), b.requires_grad_(True)
    ref = F.gelu(x + b)
    ref.backward(g)
    assert out.device == xc.device and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, **F32)
    torch.testing.assert_close(xc.grad.cpu(), x.grad, **F32)
    torch.testing.assert_close(bc.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)  # sums differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5), (8, 129), (2, 7, 33), (4, 64, 1536)])
def test_bias_gelu_in_16_bits_is_the_float_result_rounded_once(shape, dtype):
    (x, b, _, g), (xc, bc, _, gc) = _inputs(shape, dtype)
    xc, bc = _leaf(xc), _leaf(bc)
    out = fused_bias_gelu(xc, bc)
    out.backward(gc)
    z = (x.float() + b.float()).requires_grad_(True)  # the kernel adds in float
    ref = F.gelu(z)
    ref.backward(g.float())
    assert out.dtype == dtype and xc.grad.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref.detach(), **ROUNDING[dtype])
    torch.testing.assert_close(xc.grad.cpu().float(), z.grad, **ROUNDING[dtype])


def _mask_and_grad(x, b, r, g, p, seed):
    """Forward and backward with the seed drawn after manual_seed(seed): the output,
    the input's gradient (g * mask / (1 - p)) and the mask."""
    x, b, r = _leaf(x), _leaf(b), _leaf(r)
    torch.manual_seed(seed)
    out = fused_bias_dropout_add(x, b, r, p, True)
    out.backward(g)
    return out.detach(), x.grad, x.grad != 0, r.grad


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_mask_on_cuda_is_the_cpu_mask_bit_for_bit(shape, dtype, offset):
    p = 0.3
    (x, b, r, g), (xc, bc, rc, gc) = _inputs(shape, dtype, seed=1, offset=offset)
    out, gx, mask, _ = _mask_and_grad(x, b, r, g, p, seed=11)
    out_c, gx_c, mask_c, gr_c = _mask_and_grad(xc, bc, rc, gc, p, seed=11)
    assert torch.equal(mask_c.cpu(), mask)
    # the backward is g * scale or 0 on both devices: one float product, rounded alike
    assert torch.equal(gx_c.cpu(), gx)
    assert torch.equal(gr_c.cpu(), g)
    # the forward: the residual exactly where dropped, (x + b) / (1 - p) + r elsewhere
    assert torch.equal(out_c.cpu()[~mask], r[~mask])
    tol = F32 if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}  # FMA or not
    torch.testing.assert_close(out_c.cpu().float(), out.float(), **tol)
    if mask.numel() > 10_000:
        assert abs(float((~mask).float().mean()) - p) < 0.01


def test_dropout_mask_in_float16_is_the_float32_mask():
    shape, p = (37, 515), 0.25
    (x, b, r, g), _ = _inputs(shape, seed=2)
    _, _, mask, _ = _mask_and_grad(x, b, r, g, p, seed=5)
    half = [t.half().cuda() for t in (x, b, r, g)]
    _, gx_h, mask_h, _ = _mask_and_grad(*half, p, seed=5)
    assert torch.equal(mask_h.cpu(), mask)
    torch.testing.assert_close(gx_h.cpu().float(), (g.half().float() / (1 - p)) * mask,
                               rtol=2**-10, atol=1e-7)  # (float16 subnormals)


@pytest.mark.parametrize("shape", [(3, 5), (4, 64, 1536)])
def test_bias_dropout_add_without_dropout_is_the_sum_on_cuda(shape):
    (x, b, r, _), (xc, bc, rc, _) = _inputs(shape)
    for p, training in ((0.0, True), (0.4, False)):
        out = fused_bias_dropout_add(xc, bc, rc, p, training)
        torch.testing.assert_close(out.cpu(), x + b + r, rtol=1e-6, atol=1e-6)


def test_the_kernels_run_on_the_callers_stream():
    # Captured into a CUDA graph on a side stream: a launch on any other stream would
    # fail the capture, and the replay must recompute from the new inputs.
    (x, b, r, _), (xc, bc, rc, _) = _inputs((64, 1536))
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        fused_bias_gelu(xc, bc)  # warm-up outside the capture (lazy module loading)
        fused_bias_dropout_add(xc, bc, rc, 0.0, False)
        with torch.cuda.graph(graph):
            y = fused_bias_gelu(xc, bc)
            z = fused_bias_dropout_add(y, bc, rc, 0.0, False)
        xc.copy_(2 * x.cuda())
        graph.replay()
    torch.cuda.synchronize()
    ref = F.gelu(2 * x + b)
    torch.testing.assert_close(y.cpu(), ref, **F32)
    torch.testing.assert_close(z.cpu(), ref + b + r, **F32)


def test_empty_tensors_launch_nothing():
    xc = torch.empty(0, 8, device="cuda", requires_grad=True)
    bc = torch.zeros(8, device="cuda", requires_grad=True)
    out = fused_bias_gelu(xc, bc)
    out.sum().backward()
    assert out.shape == (0, 8) and torch.equal(bc.grad.cpu(), torch.zeros(8))
    assert fused_bias_dropout_add(xc, bc, xc, 0.5, True).shape == (0, 8)


def test_bad_inputs_name_both_sides():
    from pycomm._extension import load as _extension

    (_, b, _, _), (xc, bc, rc, _) = _inputs((4, 6))
    with pytest.raises(ValueError, match=r"bias is on cpu, the input on cuda:0"):
        fused_bias_gelu(xc, b)
    with pytest.raises(ValueError, match=r"bias is on cuda:0, the input on cpu"):
        fused_bias_gelu(xc.cpu(), bc)
    with pytest.raises(ValueError, match=r"residual is on cpu, the input on cuda:0"):
        fused_bias_dropout_add(xc, bc, rc.cpu(), 0.1, True)
    with pytest.raises(ValueError, match=r"bias is on cpu, the input on cuda:0"):  # C++ too
        _extension().fused_bias_gelu_cuda(xc, b)
    with pytest.raises(ValueError, match=r"bias of shape \[5\] does not match the last "
                                         r"dimension of \[4, 6\]"):
        fused_bias_gelu(xc, bc[:5])
    with pytest.raises(ValueError, match=r"bias is BFloat16, the input Float"):
        fused_bias_gelu(xc, bc.bfloat16())
    with pytest.raises(ValueError, match=r"the residual is \[4, 6\] Half, the input \[4, 6\] "
                                         r"Float"):
        fused_bias_dropout_add(xc, bc, rc.half(), 0.1, True)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 only, got Double"):
        fused_bias_gelu(xc.double(), bc.double())
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
        fused_bias_dropout_add(xc, bc, rc, 1.0, True)


def _gpt_step(fused: bool, device: str):
    from pycomm.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batch
    from pycomm.parallel.recompute import apply_fused_kernels

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    torch.manual_seed(0)
    net = GPT(cfg).to(device)
    if fused:
        assert len(apply_fused_kernels(net)) == cfg.n_layer
    x, y = synthetic_batch(cfg, 4, seed=1)
    loss = lm_loss(net(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), {n: p.grad.cpu() for n, p in net.named_parameters()}


def test_fused_gpt_blocks_on_cuda_match_the_plain_ones():
    plain, fused = _gpt_step(False, "cuda"), _gpt_step(True, "cuda")
    assert fused[0] == pytest.approx(plain[0], rel=1e-5)
    for name, grad in plain[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-4, atol=1e-5)
