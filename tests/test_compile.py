"""torch.compile with the strategies: each block compiled in place (torchtitan's way)
trains what eager trains, within fp32 rounding, under ZeRO-3, tensor and sequence
parallelism and a pipeline, and a model compiled whole before ``parallelize`` is taken
apart and compiled the same way (``tests/_compile_scenarios.py``)."""

from __future__ import annotations

import pytest

from pycomm.testing import RankPool
from tests import _compile_scenarios as sc
from tests import _real_batch_scenarios as rb

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5


def test_compiled_blocks_train_as_eager():
    with RankPool(2, backend="pycomm", pg_timeout_s=300) as pool:
        for layout, name, case in (("dp2 zero3", "llama", "packed"),
                                   ("tp2+SP", "gpt", "right_pad"),
                                   ("pp2 M=2", "qwen3", "ignored")):
            for out in pool.run(sc.curves, layout, name, case):
                for how in ("compile", "compiled model"):
                    loss, norm = rb.worst_relative(out[how], out["eager"])
                    assert loss < REL and norm < REL, (layout, name, how, loss, norm)
