"""Real batches train as one process does in every layout: prompts ignored in uneven counts
per row, right and left padding, packed documents, on the project's GPT and two
HuggingFace families (``tests/_real_batch_scenarios.py``). Each layout runs every case,
on a model that rotates with the layout and the case (every model meets every case and
every layout; ``python -m tests.real_batch_table`` runs all of them, 20 steps); the loss
and the pre-clip gradient norm of every step agree with one process within 1e-5
relative (fp32)."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _real_batch_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
STEPS = 3


def rotation(layout: str) -> list[tuple[str, str]]:
    """The (model, case) pairs a layout runs: every case, the model turning with both."""
    i = list(sc.LAYOUTS).index(layout)
    return [(sc.MODELS[(i + j) % len(sc.MODELS)], case) for j, case in enumerate(sc.CASES)]


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
            got = pool.run(sc.layout_pairs, layout, rotation(layout), STEPS)
            for rank_result in got:
                _check(rank_result, references, layout)
