"""bench.limit_states: the interleaved iterations fall into the machine's two states."""

from bench.limit_states import describe, split_by_pass_time


def rows(*pass_ms: float) -> list[dict]:
    return [{"all_reduce_ms": 5.0, "arena_all_reduce_ms": 4.0, "rmw_ms": t, "small_us": 1.5}
            for t in pass_ms]


def test_two_states_split_at_the_largest_gap():
    fast, slow = split_by_pass_time(rows(2.5, 4.4, 2.7, 4.2, 2.6, 4.3, 2.8))
    assert [r["rmw_ms"] for r in fast] == [2.5, 2.6, 2.7, 2.8]
    assert [r["rmw_ms"] for r in slow] == [4.2, 4.3, 4.4]


def test_one_state_stays_whole():
    # Evenly spread times have no gap that stands out; two outliers are not a state.
    assert len(split_by_pass_time(rows(4.0, 4.1, 4.2, 4.3, 4.4, 4.5))) == 1
    assert len(split_by_pass_time(rows(4.0, 4.1, 4.2, 4.3, 4.4, 9.0, 9.1))) == 1


def test_fraction_is_the_median_of_each_iterations_own_ratio():
    group = [{"all_reduce_ms": a, "arena_all_reduce_ms": a / 2, "rmw_ms": r, "small_us": 1.0}
             for a, r in ((5.0, 4.0), (10.0, 4.0), (4.0, 4.0))]
    assert describe(group)["fraction"] == 0.8
    assert describe(group)["arena_fraction"] == 1.6
    assert describe(group)["iterations"] == 3
