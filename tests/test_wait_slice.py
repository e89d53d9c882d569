"""A rank that sleeps for its peer asks for a short time slice, and gives it back.

Under load a rank woken by its peer's doorbell waited behind every busy thread on its
core (10-20 ms each time beside four busy loops): EEVDF runs the owed thread whose slice
ends first, and the rank's slice was as long as theirs. csrc/core/base/wait_slice.h
asks for 100 us (PYCOMM_WAIT_SLICE_US) while a wait sleeps and restores the thread's own
slice once it is awake; the send/recv engine's thread keeps it. These tests watch the
slice from a second thread while one rank waits 0.4 s for the other.
"""

from __future__ import annotations

import platform
import threading

import pytest

from pycomm.testing import run_ranks
from tests import _wait_slice_ranks as ranks

SHORT_NS = 100_000
USER_NS = 3_000_000  # a slice a user's thread set itself: the op must leave it so


def _kernel_sets_thread_slices() -> bool:
    """Whether a thread here can ask for its own slice and see it (Linux >= 6.12)."""
    if platform.machine() != "x86_64":
        return False
    ok = []

    def probe() -> None:
        try:
            ranks.set_own_slice(200_000)
            ok.append(ranks.slice_of(threading.get_native_id()) == 200_000)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return ok == [True]


pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="not x86-64: the test's "
                       "sched_setattr call uses x86-64's system call number"),
    pytest.mark.skipif(not _kernel_sets_thread_slices(), reason="no per-thread time slices "
                       "in this kernel (sched_setattr's sched_runtime, Linux >= 6.12)"),
]


def test_a_sleeping_waiter_shortens_its_slice_and_restores_it():
    per_rank = run_ranks(ranks.waits_and_slices, 2, USER_NS)
    for rank, cases in enumerate(per_rank):
        for case in cases:
            assert case["value"] == 2.0, (rank, case)
            assert case["after"] == case["before"], (
                f"rank {rank}: its slice was {case['before']} ns before the op and "
                f"{case['after']} after: the op did not give it back ({case})")
            if case["own"]:
                assert case["before"] == USER_NS, (rank, case)
            if case["waiting"]:
                assert case["samples"] >= 10, (rank, case)
                assert case["least_seen"] == SHORT_NS, (
                    f"rank {rank} slept {ranks.LATE_S} s for its peer with a slice of "
                    f"{case['least_seen']} ns at least, not {SHORT_NS} ({case})")


def test_wait_slice_zero_leaves_the_schedulers_slice():
    per_rank = run_ranks(ranks.waits_and_slices, 2, 0, env={"PYCOMM_WAIT_SLICE_US": "0"})
    for rank, cases in enumerate(per_rank):
        for case in (c for c in cases if c["waiting"]):
            assert case["least_seen"] == case["before"] == case["after"], (rank, case)


def test_the_send_recv_engine_thread_keeps_a_short_slice():
    for rank, slices in enumerate(run_ranks(ranks.engine_thread_slices, 2)):
        assert SHORT_NS in slices, (rank, slices)
    for rank, slices in enumerate(run_ranks(ranks.engine_thread_slices, 2,
                                            env={"PYCOMM_WAIT_SLICE_US": "0"})):
        assert SHORT_NS not in slices, (rank, slices)
