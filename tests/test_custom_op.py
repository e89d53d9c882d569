"""``torch.ops.pycomm.all_reduce_``: the synchronous all_reduce as one torch operator
(no torch.distributed wrapper, no Work), as DeepSpeed and vLLM expose theirs. Checked on
real ranks: every op x dtype x size against float64 on pycomm and on gloo groups (the
operator serves any backend), order with async ops in flight, inside a torch.compile
graph, autograd's version counter, and bad input."""

from __future__ import annotations

import _custom_op_scenarios as sc
import pytest

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=30.0) as p:
        yield p


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_every_op_dtype_and_size_matches_float64(pool, backend):
    problems = [p for r in pool.run(sc.every_op_dtype_and_size, backend) for p in r]
    assert not problems, problems[:20]


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_the_eager_path_matches_float64_and_follows_new_groups(pool, backend):
    problems = [p for r in pool.run(sc.eager_path_matches_the_operator, backend) for p in r]
    assert not problems, problems[:20]


def test_runs_after_the_async_ops_queued_before_it(pool):
    n = pool.world_size
    assert pool.run(sc.ordered_after_async_ops) == [[float(n ** 3), float(n)]] * n


def test_works_inside_a_compiled_graph(pool):
    n = pool.world_size
    total = 2 * sum(range(1, n + 1))  # every rank's (rank + 1) * 2, summed
    assert pool.run(sc.compiled_graph, timeout_s=300) == [[total + 1.0] * 4] * n


def test_autograd_sees_the_in_place_write(pool):
    assert all(pool.run(sc.version_counter_bumps))
    assert all(pool.run(sc.version_counter_bumps_on_the_eager_path))


def test_bad_input_gets_a_clear_error_and_the_group_goes_on(pool):
    for msgs in pool.run(sc.bad_input_errors):
        assert "unknown reduction op 'mean'" in msgs[0], msgs
        assert "no-such-group" in msgs[1], msgs
        assert "complex" in msgs[2].lower(), msgs
        assert msgs[3] == str([float(pool.world_size)] * 2)
