"""Real batches train as one process does in every layout: prompts ignored in uneven counts
per row, right and left padding, packed documents, on the project's GPT and two
HuggingFace families (``tests/_real_batch_scenarios.py``). Each layout's pool runs every
model and case in one spawn; the loss and the pre-clip gradient norm of every step agree
with one process within 1e-5 relative (fp32)."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _real_batch_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
STEPS = 3


@pytest.fixture(scope="module")
def references():
    return {(m, c): sc.one_process(m, c, STEPS) for m in sc.MODELS for c in sc.CASES}


def _check(got: dict, references: dict, layout: str) -> None:
    for key, curve in got.items():
        loss, norm = sc.worst_relative(curve, references[key])
        assert loss < REL and norm < REL, (layout, key, loss, norm)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_trains_real_batches_as_one_process(references, world):
    """Every layout of this world size, every model, every case: 3 steps each."""
    layouts = [name for name in sc.LAYOUTS if sc.world_of(name) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for layout in layouts:
            got = pool.run(sc.layout_curves, layout, sc.MODELS, sc.CASES, STEPS)
            for rank_result in got:
                _check(rank_result, references, layout)
