"""pycomm.parallel.ps.filters: codec round trips within each codec's rounding, frame sizes checked
against the meta before decoding, and the significance filter's error feedback (every
gradient pushed eventually, exactly)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pycomm.parallel.ps.filters import CODECS, SignificanceFilter, decode, encode, encoded_bytes

SHAPES = st.lists(st.integers(0, 40), min_size=0, max_size=3)  # empty, 0-d, odd sizes
BLOCKS = st.sampled_from([1, 3, 7, 64, 256])


def _values(shape: list[int], seed: int, magnitude: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 10.0**magnitude


@settings(max_examples=60, deadline=None)
@given(shape=SHAPES, block=BLOCKS, seed=st.integers(0, 2**16), magnitude=st.integers(-3, 3),
       codec=st.sampled_from(CODECS))
def test_round_trip_within_the_codecs_rounding(shape, block, seed, magnitude, codec):
    x = _values(shape, seed, magnitude)
    frames, meta = encode(x, codec, block)
    y = decode(frames, meta)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if codec == "none":
        assert torch.equal(y, x)
    elif codec in ("fp16", "bf16"):  # round to nearest, as torch's own cast
        half = torch.float16 if codec == "fp16" else torch.bfloat16
        assert torch.equal(y, x.to(half).float())
        unit = 2.0**-11 if codec == "fp16" else 2.0**-8
        assert bool(((y - x).abs() <= unit * x.abs() + 2.0**-24).all())
    else:
        _assert_int8_bound(x.reshape(-1), y.reshape(-1), block)


def _assert_int8_bound(x: torch.Tensor, y: torch.Tensor, block: int) -> None:
    """Every element within scale / 2 of its block's scale = max |x| / 127; the slack is
    float32's rounding of x / scale and of q * scale, under 2**-16 of the scale."""
    for start in range(0, x.numel(), block):
        xs, ys = x[start : start + block], y[start : start + block]
        scale = xs.abs().max() / 127
        assert bool(((ys - xs).abs() <= scale * (0.5 + 2.0**-16)).all()), (start, scale)


def test_int8_keeps_zero_blocks_and_extremes_exact():
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -2.5, 1.0, 2.5, 0.0])
    y = decode(*encode(x, "int8", block=4))
    assert torch.equal(y[:4], torch.zeros(4))  # a zero block: scale 0, no division by it
    assert y[4] == -2.5 and y[6] == 2.5  # max |x| is exactly +-127 * scale


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_int8_refuses_non_finite_values(bad):
    x = torch.ones(10)
    x[7] = bad
    with pytest.raises(ValueError, match=r"int8: block 1 holds inf or nan"):
        encode(x, "int8", block=4)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 10_000])
def test_byte_counts(n):
    x = torch.randn(n)
    blocks = -(-n // 256)
    sizes = {c: encoded_bytes(encode(x, c)[0]) for c in CODECS}
    assert sizes == {"none": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "int8": n + 4 * blocks}
    if n == 10_000:
        assert sizes["int8"] / sizes["none"] == pytest.approx(0.25 + 1 / 256, abs=1e-3)


def test_meta_is_small_and_json_able():
    frames, meta = encode(torch.ones(3, 5), "bf16", block=32)
    assert meta == {"codec": "bf16", "shape": [3, 5], "block": 32}
    assert all(isinstance(f, memoryview) for f in frames)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_decode_checks_every_frame_size(codec, change):
    frames, meta = encode(torch.randn(300), codec, block=128)
    last = bytes(frames[-1])
    frames[-1] = last[:-1] if change == "truncate" else last + b"\0"
    got = len(frames[-1])
    i = len(frames) - 1
    with pytest.raises(ValueError, match=rf"decode {codec}: frame {i} for shape \[300\] "
                       rf"should be {len(last)} bytes, got {got}"):
        decode(frames, meta)


def test_decode_checks_the_frame_count():
    frames, meta = encode(torch.randn(10), "int8")
    with pytest.raises(ValueError, match=r"decode int8: expected 2 frame\(s\) for shape \[10\]"
                       r", got 1"):
        decode(frames[:1], meta)


@pytest.mark.parametrize(("meta", "message"), [
    ({"codec": "zstd", "shape": [2], "block": 1}, r"unknown codec 'zstd'; valid codecs: "
     r"\['none', 'fp16', 'bf16', 'int8'\]"),
    ({"shape": [2]}, r"unknown codec None"),
    ({"codec": "int8", "shape": [2], "block": 0}, r"block must be an int >= 1, got 0"),
    ({"codec": "none", "shape": [-1]}, r"shape must be a list of ints >= 0, got \[-1\]"),
    ({"codec": "none", "shape": "8"}, r"shape must be a list of ints >= 0, got '8'"),
    (["none"], r"meta must be a dict, got list"),
])
def test_decode_refuses_bad_meta(meta, message):
    with pytest.raises(ValueError, match=message):
        decode([b"\0" * 8], meta)


def test_encode_refuses_unknown_codecs_and_other_dtypes():
    with pytest.raises(ValueError, match=r"unknown codec 'fp8'"):
        encode(torch.ones(2), "fp8")
    with pytest.raises(ValueError, match=r"values must be float32, got torch.float64"):
        encode(torch.ones(2, dtype=torch.float64), "none")


def _push(f: SignificanceFilter, table: str, keys: list[int], rows: list[list[float]]):
    out_keys, out = f(table, torch.tensor(keys, dtype=torch.int64), torch.tensor(rows))
    return out_keys.tolist(), out.tolist()


def test_insignificant_rows_are_held_and_re_added():
    f = SignificanceFilter(0.5)
    assert _push(f, "t", [1, 2, 3], [[0.125, -0.25], [1.0, 0.0], [0.0, -0.5]]) == (
        [2, 3], [[1.0, 0.0], [0.0, -0.5]])
    assert _push(f, "t", [1, 4], [[0.25, 0.25], [0.0, 0.0]]) == ([], [])  # 0.375 < 0.5
    assert _push(f, "t", [0, 1], [[0.5, 0.0], [0.125, 0.0]]) == (
        [0, 1], [[0.5, 0.0], [0.5, 0.0]])  # key 1's three pushes, summed
    keys, rows = f.flush("t")
    assert keys.tolist() == [4] and rows.tolist() == [[0.0, 0.0]]
    keys, rows = f.flush("t")
    assert keys.numel() == 0 and rows.shape == (0, 0)


def test_tables_hold_their_own_residuals():
    f = SignificanceFilter(1.0)
    _push(f, "a", [5], [[0.5]])
    _push(f, "b", [5], [[0.25, 0.25]])  # another table may have another d
    assert _push(f, "a", [5], [[0.5]]) == ([5], [[1.0]])
    keys, rows = f.flush("b")
    assert keys.tolist() == [5] and rows.tolist() == [[0.25, 0.25]]


def test_nan_rows_are_sent_not_held():
    f = SignificanceFilter(0.5)
    keys, rows = f("t", torch.tensor([3]), torch.tensor([[math.nan, 0.0]]))
    assert keys.tolist() == [3] and math.isnan(rows[0, 0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), threshold=st.sampled_from([0.0, 0.25, 0.75, 2.0]),
       dim=st.integers(0, 4), pushes=st.integers(1, 12))
def test_every_gradient_is_pushed_exactly_once(seed, threshold, dim, pushes):
    """Sum of what is sent plus the final flush == sum of the inputs, bit for bit: values
    are multiples of 1/8 below 2, so every float32 sum here is exact."""
    g = torch.Generator().manual_seed(seed)
    f, n_keys = SignificanceFilter(threshold), 16
    pushed, sent = torch.zeros(n_keys, dim), torch.zeros(n_keys, dim)
    for _ in range(pushes):
        keys = torch.nonzero(torch.rand(n_keys, generator=g) < 0.5).view(-1)
        values = torch.randint(-16, 17, (keys.numel(), dim), generator=g).float() / 8
        before = values.clone()
        out_keys, out = f("t", keys, values)
        assert torch.equal(values, before)  # the caller's tensor is not written
        assert bool((_row_max(out) >= threshold).all())
        pushed[keys] += values
        sent[out_keys] += out
    keys, rows = f.flush("t")
    sent[keys] += rows
    assert torch.equal(sent, pushed)


def _row_max(rows: torch.Tensor) -> torch.Tensor:
    return rows.abs().amax(dim=1) if rows.shape[1] else torch.zeros(rows.shape[0])


@pytest.mark.parametrize(("keys", "values", "message"), [
    (torch.tensor([2, 1]), torch.zeros(2, 3), r"table 't': keys must be sorted and unique"),
    (torch.tensor([1, 1]), torch.zeros(2, 3), r"keys must be sorted and unique"),
    (torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2, 3), r"keys must be 1-D int64"),
    (torch.tensor([1, 2]), torch.zeros(3, 3), r"values must be float32 of shape \(2, d\) for "
     r"2 keys, got torch.float32 \(3, 3\)"),
    (torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.float64), r"got torch.float64"),
    (torch.tensor([1, 2]), torch.full((2, 4), 0.1), r"a push of rows of 4 values, but 1 held "
     r"rows have 3"),
])
def test_bad_pushes_are_refused(keys, values, message):
    f = SignificanceFilter(1.0)
    f("t", torch.tensor([7]), torch.full((1, 3), 0.5))  # holds one row of 3 values
    with pytest.raises(ValueError, match=message):
        f("t", keys, values)


@pytest.mark.parametrize("threshold", [-1.0, math.nan, math.inf, "1", True])
def test_bad_thresholds(threshold):
    with pytest.raises(ValueError, match=r"threshold must be a finite number >= 0"):
        SignificanceFilter(threshold)
