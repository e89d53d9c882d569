"""Real batches train as one process does in every layout: prompts ignored in uneven counts
per row, right and left padding, packed documents, on the project's GPT and two
HuggingFace families (``tests/_real_batch_scenarios.py``). Each layout runs every case,
on a model that rotates with the layout and the case (every model meets every case and
every layout; ``python -m tests.real_batch_table`` runs all of them, 20 steps); the loss
and the pre-clip gradient norm of every step agree with one process within 1e-5
relative (fp32). In float64 a layout of each world size equals one process within 1e-12:
exact beyond fp32's rounding, so nothing in the step narrows a wider model to fp32."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _real_batch_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
STEPS = 3
REL_FP64 = 1e-12
# world -> the layout and the (model, case) trained in float64 there
FP64 = {2: ("dp2 zero3", ("qwen3", "left_pad")), 4: ("pp2 x dp2", ("llama", "packed")),
        8: ("2x2x2", ("gpt", "right_pad"))}


def rotation(layout: str) -> list[tuple[str, str]]:
    """The (model, case) pairs a layout runs: every case, the model turning with both."""
    i = list(sc.LAYOUTS).index(layout)
    return [(sc.MODELS[(i + j) % len(sc.MODELS)], case) for j, case in enumerate(sc.CASES)]


@pytest.fixture(scope="module")
def references():
    return {(m, c): sc.one_process(m, c, STEPS) for m in sc.MODELS for c in sc.CASES}


def _check(got: dict, references: dict, layout: str, rel: float = REL) -> None:
    for key, curve in got.items():
        loss, norm = sc.worst_relative(curve, references[key])
        assert loss < rel and norm < rel, (layout, key, loss, norm)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_trains_real_batches_as_one_process(references, world):
    """Every layout of this world size, every model, every case: 3 steps each."""
    layouts = [name for name in sc.LAYOUTS if sc.world_of(name) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for layout in layouts:
            got = pool.run(sc.layout_pairs, layout, rotation(layout), STEPS)
            for rank_result in got:
                _check(rank_result, references, layout)
        layout, (model, case) = FP64[world]
        want = {(model, case): sc.one_process(model, case, STEPS, dtype="float64")}
        for rank_result in pool.run(sc.layout_pairs, layout, [(model, case)], STEPS, "float64"):
            _check(rank_result, want, f"{layout} float64", REL_FP64)
        if world == 2:  # the vocab-parallel loss: a bad target refused on every rank
            for msgs in pool.run(sc.bad_targets_refused, "tp2"):
                assert f"target {sc.VOCAB} at (1, 3) is outside [0, {sc.VOCAB})" in msgs[0]
                assert "target -5 at (2, 5)" in msgs[1] and "ignore_index -100" in msgs[1]
                assert "targets of dtype torch.float32" in msgs[2], msgs
                assert 3.0 < float(msgs[3]) < 6.0, msgs
