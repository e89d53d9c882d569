"""How the pycomm backend behaves as a torch.distributed citizen: async ops return at
once and release the GIL, PYCOMM_DEBUG logs, subgroups, timeouts from the environment,
and private shared-memory segments."""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankPool, run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")


@pytest.fixture(scope="module")
def pool3():
    with RankPool(3, backend="pycomm", pg_timeout_s=30) as pool:
        yield pool


def _async_then_wait() -> tuple[float, bool, int, bool]:
    """Rank 1 and 2 arrive late; rank 0's async all_reduce must return at once, and while
    it waits another Python thread must keep running (the GIL is released). Returns
    (when rank 0's call returned, or when this peer called: CLOCK_MONOTONIC, one clock
    for every process of the machine; whether it was complete at once; the other
    thread's turns; whether the sum is right)."""
    rank = dist.get_rank()
    x = torch.full((1000,), float(rank + 1))
    if rank != 0:
        time.sleep(1.0)
        called_at = time.monotonic()
        dist.all_reduce(x)
        return called_at, True, 0, bool((x == 6).all())
    work = dist.all_reduce(x, async_op=True)
    returned_at = time.monotonic()
    completed_early = work.is_completed()
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    work.wait()
    stop.set()
    counter.join()
    return returned_at, completed_early, ticks, bool((x == 6).all())


def test_async_op_returns_at_once_and_wait_releases_gil(pool3):
    """By events, not by a time bound: the call returned before either peer had even
    called (a call that waited for them could not), and the other thread ran during
    the wait (with the GIL held it would not run at all; ten turns of a 1 ms sleep in
    a 1 s wait leave a loaded machine room)."""
    results = pool3.run(_async_then_wait)
    returned_at, completed_early, ticks, _correct = results[0]
    peers_called_at = min(r[0] for r in results[1:])
    assert returned_at < peers_called_at, (
        f"async all_reduce returned {returned_at - peers_called_at:.3f} s after the peers "
        "called: it blocked the caller")
    assert not completed_early, "the op cannot be complete before rank 1 arrived"
    assert ticks >= 10, f"another thread ran only {ticks} times during wait(): GIL held?"
    assert all(r[3] for r in results)


def _finished_work() -> tuple[str, bool, bool, bool, bool]:
    """A synchronous op's Work is pycomm's (a torch.distributed.Work): finished, its
    wait() returns at once, with or without a timeout, and keeps returning True."""
    work = dist.all_reduce(torch.ones(8), async_op=True)
    first = work.wait()
    return (
        type(work).__module__ + "." + type(work).__name__,
        isinstance(work, dist.Work),
        first,
        work.wait(datetime.timedelta(seconds=1)),
        work.is_completed(),
    )


def test_a_finished_work_is_pycomms_and_waits_at_once(pool3):
    # pycomm._C.Work's wait() keeps the GIL when the op is done (dist.all_reduce's
    # wait after a synchronous op): the release and retake cost the 1 KB op ~0.1 µs.
    for name, is_work, *waits in pool3.run(_finished_work):
        assert name == "pycomm._C.Work" and is_work, name
        assert all(waits), waits


def _future_chain() -> list[float]:
    x = torch.ones(10) * (dist.get_rank() + 1)
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    return doubled.wait().tolist()


def test_future_then_sees_the_result(pool3):
    for result in pool3.run(_future_chain):
        assert result == [12.0] * 10


def _profiled_op_names() -> list[str]:
    """The op events torch.profiler records for pycomm ops, synchronous (the inline path,
    which skips the profiler's bookkeeping when nobody listens) and async."""
    x = torch.ones(4)
    with torch.profiler.profile() as prof:
        dist.all_reduce(x)
        dist.all_reduce(x, async_op=True).wait()
        dist.broadcast(x, 0)
    return [e.name for e in prof.events() if e.name.startswith("pycomm:")]


def test_the_profiler_sees_every_op_sync_and_async(pool3):
    for names in pool3.run(_profiled_op_names):
        assert names.count("pycomm:all_reduce") == 2, names
        assert names.count("pycomm:broadcast") == 1, names


def _subgroup_ops() -> tuple[list[float], list[float]]:
    """A group of ranks 0 and 2 works while rank 1 takes no part; the world still works."""
    group = dist.new_group([0, 2], backend="pycomm")
    rank = dist.get_rank()
    x = torch.full((100_000,), float(rank))
    if rank in (0, 2):
        dist.all_reduce(x, group=group)
    y = torch.full((5,), float(rank))
    dist.all_reduce(y)
    dist.destroy_process_group(group) if rank in (0, 2) else None
    return x[:3].tolist(), y[:3].tolist()


def test_subgroup_with_a_rank_left_out(pool3):
    results = pool3.run(_subgroup_ops)
    assert results[0][0] == [2.0] * 3 and results[2][0] == [2.0] * 3
    assert results[1][0] == [1.0] * 3
    assert all(r[1] == [3.0] * 3 for r in results)


def _log_of_ops() -> str:
    """Captures this rank's stderr (fd 2) around a new group's init and two ops."""
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            group = dist.new_group(backend="pycomm")
            dist.all_reduce(torch.ones(4), group=group)
            dist.all_reduce(torch.ones(1 << 20), group=group)
            dist.destroy_process_group(group)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return log.read()


def test_debug_trace_logs_init_and_each_algorithm():
    logs = run_ranks(_log_of_ops, 2, env={"PYCOMM_DEBUG": "TRACE"}, pg_timeout_s=30)
    for rank, text in enumerate(logs):
        assert f" [{rank}] PYCOMM INFO init: rank {rank} of 2 on host " in text, text
        assert "PYCOMM INFO shm: segment " in text, text
        assert "PYCOMM TRACE seq 1 all_reduce float32[4] SUM: direct" in text, text
        assert "all_reduce float32[1048576] SUM: pair" in text, text  # 2 ranks


def test_segments_are_private_and_uniquely_named():
    from pycomm import _C

    name_a, mode, size = _C._probe_segment(1 << 16)
    name_b, _, _ = _C._probe_segment(1 << 16)
    assert mode == 0o600
    assert size == 1 << 16
    assert name_a.startswith("/pycomm-") and name_a != name_b
    assert not os.path.exists("/dev/shm" + name_a), "the probe's segment must be removed"


def test_segment_too_big_for_dev_shm_says_how_much():
    from pycomm import _C

    with pytest.raises(RuntimeError, match=r"/dev/shm has .* MiB free but a probe needs"):
        _C._probe_segment(1 << 50)


def test_timeout_from_environment_replaces_torch_default(monkeypatch):
    from pycomm._backend import _timeout_seconds

    monkeypatch.setenv("PYCOMM_TIMEOUT_S", "7.5")
    assert _timeout_seconds(dist.default_pg_timeout) == 7.5
    # An explicit timeout wins over the environment.
    assert _timeout_seconds(datetime.timedelta(seconds=3)) == 3.0
    monkeypatch.setenv("PYCOMM_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PYCOMM_TIMEOUT_S"):
        _timeout_seconds(dist.default_pg_timeout)
