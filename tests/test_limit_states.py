"""records.investigations.limit_states: the interleaved iterations fall into the machine's
two states."""

from records.investigations.limit_states import describe, split_by_pass_time


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


def test_a_short_job_runs_end_to_end_and_writes_its_groups(tmp_path):
    # The whole job, as a user starts it: its ranks join the store the launcher holds
    # (it once bound the launcher's port itself and died with EADDRINUSE).
    import json

    from records.investigations import limit_states

    out = tmp_path / "states.json"
    limit_states.main(["--bytes", "1M", "--iters", "3", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["meta"]["bytes"] == 1 << 20
    assert len(got["rows"]) == 3
    assert sum(g["iterations"] for g in got["groups"]) == 3
    assert all(r["all_reduce_ms"] > 0 and r["arena_all_reduce_ms"] > 0 for r in got["rows"])
