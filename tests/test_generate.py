"""Generation with the parallel engine in every layout equals the one-process model's
tokens: greedy (HuggingFace's ``generate`` for the Llama; one row, and two rows with one
left-padded) and sampled with a seed (``tests/_generate_scenarios.py``)."""

from __future__ import annotations

import pytest
import torch

from pycomm.testing import RankPool
from tests import _generate_scenarios as sc
from tests import _real_batch_scenarios as rb

pytestmark = pytest.mark.usefixtures("require_pycomm")

CASES = [("llama", False), ("gpt", False), ("gpt", True)]


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_generates_the_one_process_tokens(world):
    want = {case: sc.one_process(*case) for case in CASES}
    layouts = [name for name in rb.LAYOUTS if rb.world_of(name) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for layout in layouts:
            for case in CASES:
                for rank, got in enumerate(pool.run(sc.layout, layout, *case)):
                    for key, tokens in want[case].items():
                        assert torch.equal(got[key], tokens), (layout, case, key, rank,
                                                               got[key], tokens)
