"""bench._deepspeed: DeepSpeed's CPU shm all-reduce as a peer, on 2 spawned ranks.

The multi-rank test needs deepspeed (CI does not install it) and builds its shm
extension on first use (~1.5 min, cached in ~/.cache/torch_extensions after).
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import _deepspeed
from bench._ports import hosted_store, init_default_group
from bench._timing import count_wrong, expected, make_buffers

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# 0, 1, a count no world divides, and both sides of the op's 1 MiB switch from its
# symmetric to its distributed algorithm (in float32 and in bfloat16).
COUNTS = (0, 1, 1001, 200_003, 300_001, 600_001)
REPEATS = 4  # the op cycles through 3 state sets and 2 buffers: go round at least once


def test_missing_names_an_absent_deepspeed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert _deepspeed.missing().startswith("deepspeed is not installed")


def test_missing_refuses_ranks_on_two_hosts(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert "2 of 4 ranks are on this one" in _deepspeed.missing()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _deepspeed.missing() == ""


def test_a_lock_left_by_a_killed_build_is_named_not_waited_on(monkeypatch, tmp_path):
    """torch's extension loader waits forever on a build lock; a killed build leaves one."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _deepspeed.missing() == ""  # no lock
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory("deepspeed_shm_comm", verbose=False), "lock")
    open(lock, "w").close()
    assert _deepspeed.missing() == ""  # a build may be running now
    old = os.path.getmtime(lock) - _deepspeed.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    why = _deepspeed.missing()
    assert why.startswith("DeepSpeed's shm op build is locked by ") and lock in why, why


def _check_results(comm) -> None:
    """Every count and dtype, REPEATS times each, exact against the float64 reference."""
    for dtype in (torch.float32, torch.bfloat16):
        for count in COUNTS:
            bufs = make_buffers("all_reduce", count, dtype, comm.rank, comm.world, comm.alloc)
            run = comm.launcher("all_reduce", bufs, "sum")
            ref = expected("all_reduce", count, dtype, comm.rank, comm.world, "sum")
            for i in range(REPEATS):
                bufs.reset()
                comm.barrier()
                run()
                wrong = count_wrong(bufs.result(), ref, "sum")
                assert wrong == 0, f"{type(comm).__name__} rank {comm.rank} {dtype} " \
                                   f"count {count} call {i}: {wrong} wrong"


def _check_refusals(comm) -> None:
    cases = {
        ("all_gather", torch.float32, "sum"): "all_reduce only",
        ("all_reduce", torch.float32, "max"): "sums only",
        ("all_reduce", torch.int32, "sum"): "no torch.int32 kernel",
    }
    for case, words in cases.items():
        assert words in comm.unsupported(*case), case
    for dtype in (torch.float32, torch.bfloat16):
        assert comm.unsupported("all_reduce", dtype, "sum") == ""


def _rank(rank: int, world: int) -> None:
    for name in _deepspeed.LOCAL_SIZE_VARS:  # spawned ranks: the world is the local size
        os.environ.pop(name, None)
    init_default_group("gloo", rank, world)  # the test's store (hosted_store)
    try:
        for comm in (_deepspeed.DeepSpeedComm(), _deepspeed.DeepSpeedCommApi()):
            _check_refusals(comm)
            _check_results(comm)
        segment = _deepspeed._segment(rank)
        assert not os.path.exists(segment), f"{segment} left in /dev/shm"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)  # the first run JIT-builds DeepSpeed's shm extension
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="no DeepSpeed (deepspeed is not installed)")
def test_two_ranks_sum_exactly_and_keep_stdout_clean(capfd):
    with hosted_store(2):
        mp.spawn(_rank, args=(2,), nprocs=2, join=True)
    out = capfd.readouterr().out
    assert out == "", f"DeepSpeed wrote to stdout, where the benchmark's table goes: {out!r}"
