"""Every layout of the composition matrix saves a checkpoint and the next layout of its
world size resumes it, for the GPT and a HuggingFace Llama (taking turns by layout) with
tied and untied embeddings (``tests/_checkpoint_layout_scenarios.py``): the resumed steps'
losses equal the uninterrupted run's within 1e-5."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _checkpoint_layout_scenarios as sc
from tests import _real_batch_scenarios as rb

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_saves_and_the_next_resumes(tmp_path, world):
    layouts = [name for name in rb.LAYOUTS if rb.world_of(name) == world]
    pairs = list(zip(layouts, layouts[1:] + layouts[:1], strict=True))
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for i, (saver, loader) in enumerate(pairs):
            root = str(tmp_path / f"pair{i}")
            model = sc.MODELS[(list(rb.LAYOUTS).index(saver)) % len(sc.MODELS)]
            for key, (whole, start, resumed) in pool.run(sc.save_and_resume, saver, loader,
                                                          root, (model,))[0].items():
                assert start == sc.SAVED_AT, (saver, key, start)
                for got, want in zip(resumed, whole[start:], strict=True):
                    assert abs(got / want - 1) < REL, (saver, loader, key, got, want)
