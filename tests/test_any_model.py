"""Any ``nn.Module`` at data parallelism and ZeRO 1-3, which need no plan: a CNN whose
BatchNorm layers normalise over the whole data-parallel batch, a HuggingFace BERT on
padded batches and a ViT, each equal to one process; what needs a plan or cannot see the
whole batch is refused by name (``tests/_any_model_scenarios.py``)."""

from __future__ import annotations

import pytest
import torch

from pycomm.testing import RankPool
from tests import _any_model_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
CASES = [(kind, zero, None) for kind in ("cnn", "bert", "vit") for zero in (0, 1, 3)] + [
    ("cnn", 0, {"pp": 2}),  # a pipeline of one micro-batch: each BatchNorm sees the batch
]


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="pycomm", pg_timeout_s=60) as pool:
        yield pool


@pytest.mark.parametrize(("kind", "zero", "shape"), CASES, ids=lambda v: str(v))
def test_a_model_that_is_not_a_causal_lm_trains_as_one_process(pool2, kind, zero, shape):
    want, want_buffers = sc.one_process(kind)
    for rank, (curve, buffers) in enumerate(pool2.run(sc.layout, kind, zero, {}, shape)):
        for step, (got, ref) in enumerate(zip(curve, want, strict=True)):
            assert abs(got[0] / ref[0] - 1) < REL, (rank, step, got, ref)
            assert abs(got[1] / ref[1] - 1) < REL, (rank, step, got, ref)
        for name, value in buffers.items():  # BatchNorm's running statistics
            torch.testing.assert_close(value, want_buffers[name], rtol=1e-5, atol=1e-6)


def test_batchnorm_per_replica_only_when_asked(pool2):
    """sync_batchnorm=False normalises each replica's rows alone: another model."""
    want, _ = sc.one_process("cnn")
    curve, _ = pool2.run(sc.layout, "cnn", 0, {"sync_batchnorm": False})[0]
    assert abs(curve[0][1] / want[0][1] - 1) > 1e-3


@pytest.mark.parametrize(("kind", "shape", "config", "words"), [
    ("cnn", {"dp": 2}, {"microbatches": 2}, ["BatchNorm", "microbatches=2", "sync_batchnorm"]),
    ("bert", {"tp": 2}, {}, ["tp=2", "BertForSequenceClassification", "base_model_tp_plan",
                             "ZeRO 1-3 need none"]),
    ("vit", {"pp": 2}, {}, ["pp=2", "ViTForImageClassification"]),
    ("bert", {"dp": 2}, {"recompute": True}, ["recompute", "none could be derived"]),
], ids=["bn-microbatches", "bert-tp", "vit-pp", "bert-recompute"])
def test_what_a_model_cannot_do_is_refused_by_name(pool2, kind, shape, config, words):
    for message in pool2.run(sc.refusal, kind, shape, config):
        assert message and all(w in message for w in words), message
