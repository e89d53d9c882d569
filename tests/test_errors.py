"""Failure behaviour of the pycomm backend: missing ranks, disagreeing ranks, bad input.

Every case spawns fresh ranks (``run_ranks``) with a short group timeout, checks
the error on each rank inside the rank, and relies on the autouse conftest check
that /dev/shm is clean and no process is left. These tests need the pycomm
backend (they do not run on gloo); they fail when it cannot be loaded.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankFailure, run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")  # fails, saying why, without it

PG_TIMEOUT_S = 5.0
SLACK_S = 5.0  # "within the group timeout + a few seconds"
SEQ = r"\bseq\W{0,3}(\d+)"  # "seq 7", "seq=7", "seq #7"
SIZE = r"\d[\d,._]*\s*(bytes|B|KiB|MiB|GiB|KB|MB|GB)\b"


def run(fn, *args, world_size: int = 2, env: dict[str, str] | None = None) -> list:
    return run_ranks(fn, world_size, *args, backend="pycomm", pg_timeout_s=PG_TIMEOUT_S,
                     timeout_s=90.0, env=env)


# --- helpers run on the ranks --------------------------------------------------------


def _expect_error(call, types) -> tuple[BaseException, float]:
    """Run ``call`` (and wait on the Work it returns); return (error, seconds taken)."""
    start = time.monotonic()
    try:
        work = call()
        if work is not None:
            work.wait()
    except types as exc:
        return exc, time.monotonic() - start
    raise AssertionError(f"rank {dist.get_rank()}: expected {types}, but the call succeeded")


def _assert_mentions(message: str, *patterns: str) -> None:
    missing = [p for p in patterns if not re.search(p, message)]
    assert not missing, f"rank {dist.get_rank()}: error lacks {missing}: {message!r}"


def _rank_pattern(rank: int) -> str:
    """'rank 2', 'ranks [2]', 'missing rank(s): 2' ..."""
    return rf"rank\D{{0,20}}\b{rank}\b"


def _assert_group_failed(first: BaseException) -> None:
    """After a failed collective the next one raises at once, naming the first error."""
    seq = re.search(SEQ, str(first))
    assert seq, f"rank {dist.get_rank()}: no seq in {str(first)!r}"
    exc, elapsed = _expect_error(lambda: dist.all_reduce(torch.ones(3)), RuntimeError)
    # at once, not after the group timeout: half of it leaves a loaded machine its seconds
    assert elapsed < PG_TIMEOUT_S / 2, (
        f"rank {dist.get_rank()}: follow-up took {elapsed:.1f} s to fail")
    _assert_mentions(str(exc), rf"\bseq\W{{0,3}}{seq.group(1)}\b")


def _backend():
    """The pycomm backend object itself (bypasses ProcessGroup's per-device dispatch)."""
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


# --- a rank that never arrives -------------------------------------------------------


def _missing_rank_case(victim: int, how: str) -> str | None:
    t = torch.ones(1000)
    dist.all_reduce(t)  # one good collective first: seq is then past the first one
    if dist.get_rank() == victim:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PG_TIMEOUT_S + 1.0)  # alive but absent for the survivors' whole wait
        return None
    exc, elapsed = _expect_error(lambda: dist.all_reduce(t), dist.DistBackendError)
    assert elapsed <= PG_TIMEOUT_S + SLACK_S, f"took {elapsed:.1f} s to fail"
    if how == "sleep":  # a live, late rank must not be declared missing early
        assert elapsed >= 0.9 * PG_TIMEOUT_S, f"failed after only {elapsed:.1f} s"
    _assert_mentions(str(exc), "pycomm", "all_reduce", SEQ, _rank_pattern(victim))
    _assert_group_failed(exc)
    return str(exc)


def test_sleeping_rank_times_out_the_others():
    messages = run(_missing_rank_case, 2, "sleep", world_size=3)
    assert messages[2] is None and all(messages[:2])


def test_killed_rank_fails_the_others():
    with pytest.raises(RankFailure) as info:
        run(_missing_rank_case, 2, "kill", world_size=3)
    failures = info.value.failures
    assert set(failures) == {2}, f"only the victim may fail:\n{info.value}"
    assert failures[2].kind == "died" and "SIGKILL" in failures[2].message


# --- ranks that disagree on the same seq ---------------------------------------------

MISMATCHES = {  # rank -> its call; patterns both sides' descriptions must show
    "count": ((lambda: dist.all_reduce(torch.ones(1000)), lambda: dist.all_reduce(
        torch.ones(999))), (r"\b1000\b", r"\b999\b")),
    "dtype": ((lambda: dist.all_reduce(torch.ones(8)), lambda: dist.all_reduce(
        torch.ones(8, dtype=torch.float64))), (r"float32|\bFloat\b", r"float64|\bDouble\b")),
    "op": ((lambda: dist.all_reduce(torch.ones(8)), lambda: dist.broadcast(
        torch.ones(8), src=0)), ("all_reduce", "broadcast")),
}


def _mismatch_case(kind: str) -> None:
    calls, patterns = MISMATCHES[kind]
    dist.all_reduce(torch.ones(4))  # agree once first
    exc, elapsed = _expect_error(calls[dist.get_rank()], dist.DistBackendError)
    assert elapsed <= PG_TIMEOUT_S + SLACK_S, f"took {elapsed:.1f} s to fail"
    _assert_mentions(str(exc), "pycomm", SEQ, *patterns)
    _assert_group_failed(exc)


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_disagreeing_ranks_both_raise(kind):
    run(_mismatch_case, kind)


# --- input the backend does not support ----------------------------------------------

UNSUPPORTED = {  # case -> (call, patterns the error must show)
    "complex64_reduce": (lambda: dist.reduce(torch.ones(4, dtype=torch.complex64), dst=0),
                         (r"complex64|ComplexFloat",)),
    "complex64_backend": (lambda: _backend().allreduce([torch.ones(4, dtype=torch.complex64)]),
                          (r"complex64|ComplexFloat",)),
    "BAND_float32": (lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
                     ("BAND", r"float32|\bFloat\b")),
    "AVG_int32": (lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32),
                                          op=dist.ReduceOp.AVG), ("AVG", r"int32|\bInt\b")),
    "meta_device": (lambda: _backend().allreduce([torch.empty(4, device="meta")]),
                    ("meta",)),
}


def _unsupported_case(case: str) -> None:
    call, patterns = UNSUPPORTED[case]
    exc, _ = _expect_error(call, (ValueError, RuntimeError))
    _assert_mentions(str(exc), *patterns)


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_input_is_rejected(case):
    # dist.all_reduce views complex tensors as real, so complex64 goes through
    # dist.reduce (which does not) and through the backend object directly.
    run(_unsupported_case, case)


# --- /dev/shm too small --------------------------------------------------------------


def _first_collective_error() -> str:
    # Large enough for the ring: its channel is reserved in /dev/shm on first use.
    exc, _ = _expect_error(lambda: dist.all_reduce(torch.ones(1 << 20)), RuntimeError)
    return str(exc)


def test_shm_too_small_names_the_size_needed():
    """16 GiB slots cannot fit in this machine's /dev/shm (24 GiB, several per channel):
    the first collective that needs a channel says how much it needed and had."""
    env = {"PYCOMM_CHUNK_BYTES": str(16 << 30)}
    try:  # the error may come from init_process_group or from the first collective
        messages = run(_first_collective_error, env=env)
    except RankFailure as failure:
        assert all(f.kind == "raised" for f in failure.failures.values()), str(failure)
        assert set(failure.failures) == {0, 1}, f"every rank must raise:\n{failure}"
        messages = [f.message for f in failure.failures.values()]
    for message in messages:
        assert "/dev/shm" in message and re.search(SIZE, message), message
