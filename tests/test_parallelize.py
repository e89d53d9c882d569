"""Every 4-rank layout of (dp, tp, pp), with sequence parallelism, recompute and each
ZeRO stage where there is data parallelism, trains the same model as one process: the
loss and the global gradient norm of every step agree within 1e-5 relative (fp32)."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _parallelize_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # (dp, tp, pp)
CASES = [(lay, {}) for lay in LAYOUTS] + [
    ((2, 2, 1), {"sequence_parallel": True}),
    ((1, 2, 2), {"sequence_parallel": True, "recompute": True}),
    ((2, 1, 2), {"recompute": True, "schedule": "gpipe", "microbatches": 4}),
    ((1, 4, 1), {"recompute": True, "partition_activations": True}),
]


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, backend="pycomm", pg_timeout_s=60) as pool:
        yield pool


@pytest.fixture(scope="module")
def reference():
    return sc.one_process()


@pytest.mark.parametrize(("lay", "config"), CASES, ids=lambda v: str(v))
def test_layout_trains_like_one_process(pool4, reference, lay, config):
    for rank, curve in enumerate(pool4.run(sc.layout, *lay, config)):
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(
                zip(curve, reference, strict=True)):
            assert abs(loss / want_loss - 1) < REL, (rank, step, loss, want_loss)
            assert abs(norm / want_norm - 1) < REL, (rank, step, norm, want_norm)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_recompute_with_dropout_gives_bit_identical_gradients(pool4, sp):
    """TP x PP with dropout 0.1: recomputing every block replays every random stream
    (torch's and the tensor-parallel ones), so the gradients equal the run that keeps
    its activations, bit for bit."""
    for rank, diff in enumerate(pool4.run(sc.recompute_gradients, 1, 2, 2, sp)):
        assert diff == 0.0, f"rank {rank}: gradients differ by {diff:.3g}"
