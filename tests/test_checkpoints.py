"""Sharded checkpoints on torch.distributed.checkpoint: each rank writes its own pieces
(no rank gathers the model: before, ``engine.save`` assembled the whole model and its
Adam state on every data-parallel rank), any layout loads any other, one process
included, and a HuggingFace model's checkpoint exports to a folder ``from_pretrained``
loads, with the engine's logits."""

from __future__ import annotations

import pytest

from bench import _dcp_runs as dr
from bench import _model_zoo as zoo
from pycomm.testing import RankPool

pytest.importorskip("transformers", reason="no transformers (the [hf] extra): the "
                    "HuggingFace model whose export these tests load")
pytestmark = pytest.mark.usefixtures("require_pycomm")

RECIPE = zoo.Recipe(steps=6)
SAVED_AT = 3
REL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Llama trained at 2x2x1 with ZeRO-1, checkpointed after step 3 of 6."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    with RankPool(4, backend="pycomm", pg_timeout_s=120) as pool:
        ranks = pool.run(dr.save_then_train, "llama", (2, 2, 1), 1, RECIPE, SAVED_AT, path)
        resumed = pool.run(dr.resume, "llama", (1, 2, 2), 3, RECIPE, path)[0]
    with RankPool(1, backend="pycomm", pg_timeout_s=120) as pool:
        alone = pool.run(dr.resume, "llama", (1, 1, 1), 0, RECIPE, path)[0]
    return {"path": path, "ranks": ranks, "resumed": {"1x2x2 zero3": resumed, "1x1x1": alone}}


@pytest.mark.parametrize("where", ["1x2x2 zero3", "1x1x1"])
def test_a_checkpoint_resumes_in_another_layout(saved, where):
    run = saved["resumed"][where]
    whole = saved["ranks"][0]["losses"]
    assert run["start"] == SAVED_AT
    for step, (got, want) in enumerate(zip(run["losses"], whole[SAVED_AT:], strict=True)):
        assert abs(got / want - 1) < REL, (where, SAVED_AT + step, got, want)


def test_each_rank_writes_its_own_pieces(saved):
    """The files hold the model and its Adam state once (replicas' pieces written once),
    and no rank writes more than twice its share. (What saving adds to a rank's memory
    is measured at a size where it means something: python -m bench.dcp.)"""
    model = zoo.build("llama")
    state = 3 * 4 * sum(p.numel() for p in model.parameters())  # fp32 values and 2 moments
    written = [r["bytes"] for r in saved["ranks"]]
    assert sum(written) == state, (written, state)
    assert max(written) < 2 * state / len(written), written


def test_the_export_loads_in_transformers_with_the_engines_logits(saved, tmp_path):
    got = dr.exported_logits("llama", saved["path"], str(tmp_path / "hf"))
    want = saved["ranks"][0]["logits"]
    assert float((got - want).abs().max()) < 1e-5
