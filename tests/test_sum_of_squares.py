"""pycomm.parallel.precision.sum_of_squares, which every gradient norm of the project goes
through (in memory, ZeRO's and offload's): the float64 sum of squares, taken a chunk at
a time so that no float64 copy of a whole gradient exists at the step's peak."""

from __future__ import annotations

import pytest
import torch

from pycomm.parallel import precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_equals_the_float64_sum_across_chunk_boundaries(monkeypatch, dtype):
    monkeypatch.setattr(precision, "SQUARES_CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    for numel in (0, 1, 999, 1000, 2500):
        t = (torch.randn(numel, generator=gen) * 1e3).to(dtype).reshape(-1, 1)
        got = precision.sum_of_squares(t)
        want = t.double().square().sum()
        assert got.dtype == torch.float64 and got.dim() == 0
        assert float(got) == pytest.approx(float(want), rel=1e-14, abs=0.0)


def test_no_float64_copy_of_the_whole_tensor(monkeypatch):
    """Every float64 tensor it makes is one chunk long."""
    monkeypatch.setattr(precision, "SQUARES_CHUNK", 256)
    made = []
    real = torch.Tensor.double

    def recording(self: torch.Tensor) -> torch.Tensor:
        out = real(self)
        made.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "double", recording)
    precision.sum_of_squares(torch.ones(10_000))
    assert made and max(made) <= 256
