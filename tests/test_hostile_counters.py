"""Counters a peer publishes in the group's shared segment are not trusted: 2**62 written
into a peer's two-shot stage counter (or its count of finished collectives) while 3 ranks
run checked all_reduces gives an error naming the rank and the counter, never a wrong
sum (before: 28 / 20 / 19 wrong results on ranks 0/1/2, every rank exiting 0)."""

from __future__ import annotations

import pytest

from pycomm.testing import run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")

ENV = {"PYCOMM_STRIPES": "1"}  # one segment for the group: the one rank 0 made


@pytest.mark.parametrize("victim", [1, 2])
def test_a_stage_counter_beyond_any_peers_is_named_not_followed(victim):
    from _hostile_counter_ranks import stage_scribbled

    results = run_ranks(stage_scribbled, 3, victim, env=ENV, pg_timeout_s=30.0,
                        timeout_s=120.0)
    named = []
    for rank, outcomes in enumerate(results):
        assert False not in outcomes, f"rank {rank}: a wrong sum while the counter was bad"
        named += [o for o in outcomes if isinstance(o, str) and "'s stage reads" in o]
    assert named, f"no rank read the scribbled counter in 30 all_reduces: {results}"
    assert f"rank {victim}'s stage reads {1 << 62}" in named[0], named[0]
    assert "written by something other than pycomm" in named[0], named[0]


def test_a_finished_count_beyond_any_peers_never_gives_a_wrong_sum():
    from _hostile_counter_ranks import completed_scribbled

    results = run_ranks(completed_scribbled, 3, 1, env=ENV, pg_timeout_s=30.0,
                        timeout_s=120.0)
    for rank, outcomes in enumerate(results):
        assert False not in outcomes, f"rank {rank}: a wrong sum after the scribble"
        errors = [o for o in outcomes if isinstance(o, str)]
        for message in errors:  # where a rank read the count, it names it
            assert "pycomm" in message, message


@pytest.mark.parametrize("word", [0x3A5F_9C17, 0xFFFF_FFFF, (7 << 2) | 2])
def test_a_failure_record_naming_no_rank_is_said_to_be_that(word):
    """Random bytes in the group's failure record: every rank stops, and is told the
    record names no rank of the group (before: "rank 241993508 failed, and exited before
    it could say why")."""
    from _hostile_counter_ranks import failure_record_scribbled

    results = run_ranks(failure_record_scribbled, 3, word, env=ENV, pg_timeout_s=30.0,
                        timeout_s=120.0)
    for message in results[1:]:
        assert f"the group's failure record reads {word}, which names no rank of the 3" in (
            message), message
