"""The CUDA ring's host-side failure handling, in real processes, without a GPU.

``pycomm._C._RingSync`` is the ring's host synchronisation (csrc/cuda/host/ring_sync.h)
walking the GPU path's own plans (ring_walk.h) with no device work, over a real
/dev/shm segment and a TCPStore. Each test starts fresh processes (forkserver: cheap)
that run several cases in a row; every case has its own ring. Checked: ranks that call
different ops both raise naming both calls; a killed peer is reported as dead long
before the timeout; an abort reaches the waiting ranks with its reason; a peer that
never posts times out naming rank, op, sequence number and the awaited rank; teardown
never waits without bound.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import wait

import pytest
import torch.distributed as dist

from tests import _ring_sync_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")  # fails, saying why, without it
try:
    from pycomm import _C  # type: ignore[attr-defined]
except ImportError:  # every test then fails in require_pycomm (a named skip on gloo)
    _C = None

PROMPT_S = 5.0  # "promptly": far below the 60 s timeout, with room for a loaded machine


def run_cases(size: int, cases: list[tuple[str, dict]], limit_s: float = 120.0) -> list[list]:
    """Run ``cases`` in order on ``size`` fresh processes; per rank, one dict per case
    it finished (a killed rank's list is shorter)."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    procs, conns = [], []
    try:
        for rank in range(size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=sc.serve, args=(child, rank, size, store.port, cases),
                               name=f"ring-sync-rank{rank}", daemon=True)
            proc.start()
            child.close()  # so that EOF comes when the process ends
            procs.append(proc)
            conns.append(parent)
        results: list[list] = [[] for _ in range(size)]
        pending = set(range(size))
        deadline = time.monotonic() + limit_s
        while pending and time.monotonic() < deadline:
            wait([conns[r] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
            for rank in sorted(pending):
                try:
                    while conns[rank].poll():
                        results[rank].append(conns[rank].recv())
                except EOFError:
                    pending.discard(rank)
        assert not pending, f"ranks {sorted(pending)} did not finish in {limit_s} s: {results}"
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()


def _error(result: dict) -> str:
    assert "raised" not in result, result["raised"]
    assert result["error"], f"expected an error, got {result}"
    return result["error"]


def test_ranks_that_agree_walk_every_kind_without_alarm():
    for size in (2, 3):
        results = run_cases(size, [("agreeing_ops", {})])
        for rank, (out,) in enumerate(results):
            assert "raised" not in out, out
            assert out["error"] is None, f"rank {rank}: {out['error']}"
            assert out["value"] == list(range(1, len(out["value"]) + 1))
            assert out["failed_by"] == -1
            assert out["drained"] is True


DISAGREEMENTS = [
    # (rank 0's call, rank 1's call, how rank 0's reads, how rank 1's reads)
    ({"kind": "all_reduce", "count": 1000}, {"kind": "all_reduce", "count": 2000},
     "all_reduce float32[1000] SUM", "all_reduce float32[2000] SUM"),
    ({"kind": "all_reduce", "count": 64}, {"kind": "broadcast", "count": 64, "op": "none"},
     "all_reduce float32[64] SUM", "broadcast float32[64] root 0"),
    ({"kind": "all_gather", "count": 8, "op": "none", "dtype": "float16"},
     {"kind": "all_gather", "count": 8, "op": "none", "dtype": "bfloat16"},
     "all_gather float16[8]", "all_gather bfloat16[8]"),
    ({"kind": "reduce_scatter", "count": 8, "op": "max"},
     {"kind": "reduce_scatter", "count": 8, "op": "min"},
     "reduce_scatter float32[8] MAX", "reduce_scatter float32[8] MIN"),
]


def test_ranks_that_call_different_ops_both_raise_naming_both_calls():
    cases = [("disagreeing_call", {"calls": [a, b], "agreed_first": i % 2})
             for i, (a, b, _, _) in enumerate(DISAGREEMENTS)]
    results = run_cases(2, cases)
    for i, (_, _, mine, theirs) in enumerate(DISAGREEMENTS):
        seq = 1 + i % 2
        for rank in (0, 1):
            err = _error(results[rank][i])
            assert f"ranks disagree at seq {seq}" in err, err
            assert mine in err and theirs in err, err
            assert results[rank][i]["elapsed"] < PROMPT_S, results[rank][i]


def test_a_disagreement_past_the_call_history_is_caught_by_the_slot_tag():
    r0, r1 = run_cases(2, [("runs_ahead_then_disagrees", {})])
    err = _error(r0[0])
    assert "ranks disagree at seq 1" in err, err
    assert "rank 0 called all_reduce float32[1] SUM" in err, err
    assert "rank 1 called broadcast float32[1] root 1" in err, err
    later = _error(r1[0])  # rank 1's next op: the job failed
    assert "recorded by rank 0" in later and "ranks disagree at seq 1" in later, later


@pytest.mark.parametrize("size", [2, 3])
def test_an_abort_reaches_the_waiting_ranks_promptly_with_its_reason(size):
    results = run_cases(size, [("abort_while_peer_waits", {})])
    for rank in range(1, size):
        out = results[rank][0]
        err = _error(out)
        assert "recorded by rank 0" in err, err
        assert "rank 0 aborted the process group (test)" in err, err
        assert f"(seq 1) on rank {rank}" in err, err
        assert out["elapsed"] < PROMPT_S, out


def test_a_peer_that_never_posts_times_out_naming_rank_op_seq_and_the_awaited_rank():
    cases = [("peer_never_posts", {"enters": True}), ("peer_never_posts", {"enters": False})]
    r0, r1 = run_cases(2, cases)
    for i, why in enumerate(["every rank arrived at seq 1", "rank 1 is at seq 0"]):
        out = r0[i]
        err = _error(out)
        assert "all_reduce float32[8] SUM (seq 1) on rank 0 timed out after 1.0 s" in err, err
        assert "waiting for rank 1 to post step 0" in err, err
        assert why in err, err
        assert 0.9 <= out["elapsed"] < 1.0 + PROMPT_S, out
        # The timeout is the job's failure: rank 1 finds rank 0's message in the record.
        assert r1[i]["failed_by"] == 0, r1[i]
        assert r1[i]["abort_message"] in err, (r1[i], err)


def test_a_peer_that_leaves_is_reported_instead_of_waited_for():
    r0, _ = run_cases(2, [("peer_leaves", {})])
    err = _error(r0[0])
    assert "rank 1 left the group" in err and "to post step 0" in err, err
    assert r0[0]["elapsed"] < PROMPT_S, r0[0]


@pytest.mark.parametrize("size,victim", [(2, 1), (3, 1)], ids=["awaited", "further-round"])
def test_a_killed_peer_is_reported_dead_long_before_the_timeout(size, victim):
    results = run_cases(size, [("peer_killed", {"victim": victim})])
    assert results[victim] == [], "the victim was to die without reporting"
    out = results[0][0]
    err = _error(out)
    assert f"rank {victim} died" in err, err
    assert "all_reduce float32[8] SUM (seq 1)" in err, err
    assert out["elapsed"] < PROMPT_S, out
    # Teardown does not wait for a dead rank (nor, in a failed job, for anyone long).
    assert out["drain_s"] < 3.0, out
    if size == 2:
        assert out["drained"] is True, out


def test_teardown_waits_for_a_live_peer_only_within_its_bound():
    r0, r1 = run_cases(2, [("teardown_waits_for_peer", {}), ("teardown_hurries_when_failed", {})])
    first, second = r0[0]["first"], r0[0]["second"]
    assert first["value"] is False and 0.9 <= first["elapsed"] < 1.0 + PROMPT_S, first
    assert second["value"] is True, second
    assert r1[0]["value"] is True, r1[0]
    hurried = r0[1]
    assert hurried["value"] is False and hurried["elapsed"] < 3.0, hurried


def test_the_abort_record_is_always_one_ranks_whole_message():
    results = run_cases(2, [("concurrent_aborts", {"rounds": 20})])
    for rank, (out,) in enumerate(results):
        assert "raised" not in out, out
        assert out["bad"] == [], f"rank {rank}: {out['bad']}"


def test_a_ring_with_too_many_slots_is_refused():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="2 to 64 slots"):
        _C._RingSync(store, 0, 1, slots=65)
