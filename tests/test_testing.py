"""Tests of pycomm.testing itself (run_ranks, RankPool), on gloo so pycomm is not needed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankFailure, RankPool, held_store, run_ranks

BACKEND = "gloo"


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, backend=BACKEND, pg_timeout_s=5.0) as p:
        yield p


# --- functions run on the ranks (module level: they are pickled by reference)


def _whoami(tag: str) -> tuple:
    return (tag, dist.get_rank(), dist.get_world_size(), dist.get_backend())


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _raise_on(rank: int) -> int:
    if dist.get_rank() == rank:
        print(f"about to fail on rank {rank}")
        raise ValueError(f"boom from {rank}")
    return dist.get_rank()


def _exit_on(rank: int, code: int) -> int:
    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()


def _sigkill_on(rank: int) -> int:
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def _sleep_on(rank: int, seconds: float) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


class _Unpicklable(Exception):
    """An exception holding a lock: it cannot be pickled back to the parent."""

    def __init__(self):
        super().__init__("cannot pickle me")
        self.lock = threading.Lock()


def _raise_unpicklable() -> None:
    raise _Unpicklable()


def _return_unpicklable() -> object:
    return threading.Lock()


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _raise_then_peer_waits() -> None:
    """Rank 0 fails at once; rank 1 blocks in a collective until the group times out."""
    if dist.get_rank() == 0:
        raise AssertionError("rank 0 gave up")
    dist.all_reduce(torch.ones(1))


# --- tests


def test_results_are_ordered_by_rank(pool):
    assert pool.run(_whoami, "x") == [("x", 0, 2, "gloo"), ("x", 1, 2, "gloo")]
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]


def test_failing_rank_is_named_with_traceback(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on, 1)
    assert set(info.value.failures) == {1}
    text = str(info.value)
    assert "rank 1: raised: ValueError: boom from 1" in text
    assert "in _raise_on" in text  # the traceback names the failing function
    assert "output of rank 1:\nabout to fail on rank 1" in text  # its stdout is quoted
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]  # the pool restarts itself


def test_exit_code_is_reported(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_exit_on, 1, 3)
    assert set(info.value.failures) == {1}
    assert info.value.failures[1].kind == "died"
    assert "exited with code 3" in str(info.value)


def test_clean_exit_without_result_is_a_failure(pool):
    with pytest.raises(RankFailure, match="rank 0: died: exited with code 0"):
        pool.run(_exit_on, 0, 0)


def test_signal_is_reported(pool):
    with pytest.raises(RankFailure, match="rank 0: died: killed by signal SIGKILL"):
        pool.run(_sigkill_on, 0)


def test_unpicklable_exception_and_result(pool):
    with pytest.raises(RankFailure, match="_Unpicklable: cannot pickle me"):
        pool.run(_raise_unpicklable)
    with pytest.raises(RankFailure, match="while pickling the result"):
        pool.run(_return_unpicklable)


def test_timeout_stops_the_silent_rank(pool):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_sleep_on, 0, 60.0, timeout_s=2.0)
    assert time.monotonic() - start < 10
    assert info.value.failures[0].kind == "timeout"
    assert set(info.value.failures) == {0}


def test_lambda_is_rejected_before_spawning(pool):
    with pytest.raises(Exception, match=r"pickle|lambda"):
        pool.run(lambda: 1)


def test_run_ranks_applies_env_and_tears_down():
    env = {"PYCOMM_TESTING_PROBE": "42"}
    assert run_ranks(_env, 2, "PYCOMM_TESTING_PROBE", backend=BACKEND, env=env) == ["42"] * 2
    # A variable torch might read at import makes the ranks start with "spawn".
    env = {"TESTING_PROBE": "7"}
    assert run_ranks(_env, 1, "TESTING_PROBE", backend=BACKEND, env=env) == ["7"]


def test_rank_env_applies_per_rank_after_env():
    env = {"PYCOMM_TESTING_PROBE": "all"}
    rank_env = {1: {"PYCOMM_TESTING_PROBE": "one"}, 2: {"PYCOMM_TESTING_OTHER": "x"}}
    got = run_ranks(_env, 3, "PYCOMM_TESTING_PROBE", backend=BACKEND, env=env, rank_env=rank_env)
    assert got == ["all", "one", "all"]
    got = run_ranks(_env, 3, "PYCOMM_TESTING_OTHER", backend=BACKEND, rank_env=rank_env)
    assert got == [None, None, "x"]


def test_run_ranks_reports_peer_stuck_in_collective():
    """After one rank fails the others get the group timeout to report their error."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_then_peer_waits, 2, backend=BACKEND, pg_timeout_s=2.0, timeout_s=60.0)
    failures = info.value.failures
    assert set(failures) == {0, 1}
    assert failures[0].type_name == "AssertionError"
    assert failures[1].kind == "raised"  # gloo's own timeout error, not "killed"


def test_a_held_store_keeps_its_port_until_the_block_ends():
    """The port is bound while the block runs (no other process can take it: the race
    of a port picked free and bound later), and a client joins it."""
    import datetime
    import socket

    with held_store(1) as port:
        with socket.socket() as sock, pytest.raises(OSError):
            sock.bind(("127.0.0.1", port))
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client


class _ExitsAfterSending:
    """A rank (its pipe and process) that sends its answer and exits just after the
    parent looked at the pipe and before it asks whether the process lives."""

    exitcode = 0

    def __init__(self):
        self.polls = 0

    def poll(self) -> bool:
        self.polls += 1
        return self.polls > 1  # empty at the first look, the answer there after

    def recv_bytes(self) -> bytes:
        import pickle

        return pickle.dumps(("result", None))

    def is_alive(self) -> bool:
        return False

    def join(self) -> None:
        pass


def test_a_rank_that_answers_and_exits_at_once_is_not_reported_dead():
    from pycomm.testing import _poll

    rank = _ExitsAfterSending()
    assert _poll(rank, rank) == ("result", None)
