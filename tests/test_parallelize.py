"""Every 4-rank layout of (dp, tp, pp), with sequence parallelism, recompute and each
ZeRO stage where there is data parallelism, trains the same model as one process: the
loss and the global gradient norm of every step agree within 1e-5 relative (fp32).
Checkpoints written in one layout resume in another."""

from __future__ import annotations

import pytest
import torch

from pycomm.testing import RankPool
from tests import _parallelize_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # (dp, tp, pp)
ZERO = [(lay, {"zero": z}) for lay in LAYOUTS if lay[0] > 1 for z in (1, 2, 3)]
CASES = [(lay, {}) for lay in LAYOUTS] + ZERO + [
    ((2, 2, 1), {"sequence_parallel": True}),
    ((1, 2, 2), {"sequence_parallel": True, "recompute": True}),
    ((2, 1, 2), {"recompute": True, "schedule": "gpipe", "microbatches": 4}),
    ((1, 4, 1), {"recompute": True, "partition_activations": True}),
    ((2, 2, 1), {"zero": 3, "sequence_parallel": True, "recompute": True}),
    ((2, 1, 2), {"zero": 2, "recompute": True, "schedule": "gpipe"}),
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


RESUMES = [  # (saved at, zero) -> (resumed in, zero): layouts, DP sizes and stages all change
    (((2, 2, 1), 2), ((1, 2, 2), 3)),
    (((2, 2, 1), 1), ((1, 1, 4), 0)),
    (((4, 1, 1), 3), ((2, 2, 1), 1)),
]


@pytest.mark.parametrize(("saved", "resumed"), RESUMES, ids=lambda v: str(v))
def test_a_checkpoint_resumes_in_another_layout(pool4, tmp_path, saved, resumed):
    """Save after step 2 in one layout; the steps after, resumed in another, equal the
    uninterrupted run's."""
    (lay, zero), (lay2, zero2) = saved, resumed
    path = str(tmp_path / "ckpt")
    whole = pool4.run(sc.layout_with_checkpoint, *lay, zero, path, "save")[0]
    rest = pool4.run(sc.layout_with_checkpoint, *lay2, zero2, path, "load")[0]
    for step, (got, want) in enumerate(zip(rest, whole[2:], strict=True), start=2):
        assert abs(got / want - 1) < REL, (step, got, want)


def test_consolidate_gives_the_plain_model(pool4, tmp_path):
    """The consolidated checkpoint is a plain GPT state dict (every name and shape) whose
    weights give the loss the sharded run had at the step after the save."""
    from pycomm.parallel.checkpointing.parallel_model import consolidate
    from pycomm.parallel.models import GPT, lm_loss

    path = str(tmp_path / "ckpt")
    losses = pool4.run(sc.layout_with_checkpoint, 1, 2, 2, 3, path, "save")[0]
    model = GPT(sc.CFG)
    model.load_state_dict(consolidate(path))  # strict: every name, every shape
    with torch.no_grad():
        got = lm_loss(model(sc.batch(2)[0]), sc.batch(2)[1]).item()
    assert abs(got / losses[2] - 1) < REL, (got, losses[2])
