"""pycomm's dispatch and combine (``pycomm.dispatch``, ``torch.ops.pycomm.all_to_all_counted``):
the all_to_all of expert parallelism whose receive counts are learned inside the op. On
real ranks, 2 and 3 of them: every dtype x counts per rank x row shape against gloo's
``all_to_all_single`` (on pycomm groups and, through the operator's fallback, on gloo
groups), gradients through both ops, more counts than the op's offer holds, and bad input
refused with the group going on."""

from __future__ import annotations

import _dispatch_scenarios as sc
import pytest

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=30.0) as p:
        yield p


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_dispatch_and_combine_equal_all_to_all_single(pool, backend):
    problems = [p for r in pool.run(sc.matches_all_to_all, backend) for p in r]
    assert not problems, problems[:20]


def test_gradients_return_to_their_rows(pool):
    assert all(pool.run(sc.gradients_return_to_their_rows))


def test_bad_input_gets_a_clear_error_and_the_group_goes_on(pool):
    for msgs in pool.run(sc.bad_input_errors):
        assert "send_counts must be int64 of shape" in msgs[0], msgs
        assert "send_counts must be int64 of shape" in msgs[1], msgs
        assert "sum to" in msgs[2] and "input has 4" in msgs[2], msgs
        assert "negative count" in msgs[3], msgs
        assert msgs[4] == f"(0, 2) ({pool.world_size}, 100000) 0", msgs
        assert msgs[5] == str([float(r) for r in range(pool.world_size)]), msgs
