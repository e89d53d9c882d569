"""Counters a peer publishes in the group's shared segment are not trusted: 2**62 written
into a peer's two-shot stage counter (or its count of finished collectives) while 3 ranks
run checked all_reduces gives an error naming the rank and the counter, never a wrong
sum (before: 28 / 20 / 19 wrong results on ranks 0/1/2, every rank exiting 0)."""

from __future__ import annotations

import random

import pytest
from _hostile_counter_ranks import HUGE

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


def test_a_send_recv_head_beyond_its_slots_is_named():
    """A job that never sends: 2**62 in rank 1's head of its send/recv channel to rank 0.
    Before: "rank 1 sent all_reduce float32[0] SUM ... but it is not the start of
    message 1"."""
    from _hostile_counter_ranks import recv_after_p2p_head_scribbled

    told = run_ranks(recv_after_p2p_head_scribbled, 2, HUGE, env=ENV, pg_timeout_s=30.0,
                     timeout_s=120.0)[0]
    assert f"rank 1's head reads {HUGE}, outside what it can have published" in told, told
    assert "send/recv channel from rank 1 to rank 0" in told, told
    assert "written by something other than pycomm" in told, told


def test_a_send_recv_message_nobody_wrote_is_named_by_its_header():
    """The head one ahead, over a message never written (its header all zeros)."""
    from _hostile_counter_ranks import recv_after_p2p_head_scribbled

    told = run_ranks(recv_after_p2p_head_scribbled, 2, 1, env=ENV, pg_timeout_s=30.0,
                     timeout_s=120.0)[0]
    assert "rank 1's send/recv message header reads seq 0" in told, told
    assert "which no pycomm rank publishes" in told, told


@pytest.mark.parametrize(("victim", "name", "peer"), [(1, "coll_head", 2), (2, "coll_tail", 1)])
def test_a_collective_channel_counter_beyond_its_bounds_is_named_not_followed(victim, name,
                                                                             peer):
    """2**62 written, again and again, into a channel counter of the ring all_reduces the
    ranks run: no wrong sum, and the error names the counter."""
    from _hostile_counter_ranks import coll_counter_scribbled

    results = run_ranks(coll_counter_scribbled, 3, victim, name, peer,
                        env={**ENV, "PYCOMM_ALGO": "ring"}, pg_timeout_s=30.0, timeout_s=120.0)
    named = []
    for rank, outcomes in enumerate(results):
        assert False not in outcomes, f"rank {rank}: a wrong sum while the counter was bad"
        named += [o for o in outcomes if isinstance(o, str) and "collective channel" in o]
    assert named, f"no rank read the scribbled counter in 30 all_reduces: {results}"
    counter = name.split("_")[1]
    assert f"rank {victim}'s {counter} reads {HUGE}" in named[0], named[0]


def test_a_descriptor_no_rank_could_publish_is_named_as_such():
    """Before: "rank 0 called reduce_scatter float32[17510165073331455298]", read as if a
    rank had called it."""
    from _hostile_counter_ranks import descriptor_garbled

    count = 17510165073331455298
    told = run_ranks(descriptor_garbled, 3, count, env=ENV, pg_timeout_s=30.0,
                     timeout_s=120.0)
    waiting = [told[0], told[2]]
    named = [m for m in waiting if "rank 1's descriptor of its call reads" in m]
    assert named, told
    assert f"kind {0xDEAD}, dtype 0, count {count}" in named[0], named[0]
    assert "which no pycomm rank publishes" in named[0], named[0]


# Every 64-bit control word a rank publishes per op (its counters, its descriptor, its
# channels' heads and tails), each at a peer and a value drawn from one seed.
_WORDS = [("stage", 1, -1), ("completed_seq", 2, -1), ("recent", 1, -1),
          ("coll_head", 1, 0), ("coll_tail", 2, 1), ("p2p_head", 2, 0), ("p2p_tail", 1, 2)]
_DRAW = random.Random(60)
FUZZ = [pytest.param(name, victim, peer, _DRAW.getrandbits(64), id=f"{name}-rank{victim}")
        for name, victim, peer in _WORDS]


@pytest.mark.parametrize(("name", "victim", "peer", "value"), FUZZ)
def test_a_random_word_in_any_control_word_never_gives_a_wrong_result(name, victim, peer,
                                                                      value):
    """A random value kept written into one control word while 3 ranks run a checked mix
    of ops that reads every kind (two-shot and small all_reduces, all_gather,
    broadcast, a send/recv ring): every result is right, and a rank that stops says why
    in pycomm's words (the word, or the group's failure), never by waiting out the
    timeout. (With seed 60: stage, completed_seq and the send/recv head are named; the
    others are rewritten by their owner before a peer reads them.)"""
    from _hostile_counter_ranks import word_scribbled

    results = run_ranks(word_scribbled, 3, name, victim, peer, value, env=ENV,
                        pg_timeout_s=30.0, timeout_s=120.0)
    for rank, outcomes in enumerate(results):
        assert False not in outcomes, f"rank {rank}: a wrong result with {name} = {value}"
        for message in (o for o in outcomes if isinstance(o, str)):
            assert "pycomm" in message and "timed out" not in message, (rank, message)
