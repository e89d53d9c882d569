"""Rank functions for tests/test_hostile_counters.py: rank 0 writes 2**62 into a peer's
control word in the group's shared segment (a stray write, or a process of the same
user) and the ranks run two-shot all_reduces (3 ranks, 300_001 floats)."""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist

N = 300_001  # the two-shot at 3 ranks: steps synchronised through the stage counters
HUGE = 1 << 62


def _segment_base() -> int:
    """Where this process (rank 0, which made the group's segment and named it after
    its pid) maps that segment: its name is unlinked once every rank has attached."""
    mine = f"/dev/shm/pycomm-{os.getpid()}-"
    with open("/proc/self/maps") as maps:
        found = [line.split() for line in maps if mine in line]
    starts = [int(f[0].split("-")[0], 16) for f in found if int(f[2], 16) == 0]
    assert len(starts) == 1, found
    return starts[0]


def _scribble(victim: int, counter: str) -> None:
    from pycomm import _C

    offset = _C._control_word(dist.get_world_size(), victim, counter)
    ctypes.c_uint64.from_address(_segment_base() + offset).value = HUGE


def _all_reduce() -> bool:
    """One all_reduce of N floats; whether every element is the right sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    y = torch.full((N,), float(rank + 1))
    dist.all_reduce(y)
    return bool(torch.all(y == float(world * (world + 1) // 2)))


def _outcomes(ops: int) -> list[bool | str]:
    """Whether each of ``ops`` all_reduces was right, ending with the error that stopped
    them, if one did."""
    out: list[bool | str] = []
    try:
        for _ in range(ops):
            out.append(_all_reduce())
    except dist.DistBackendError as e:
        out.append(str(e))
    return out


def stage_scribbled(victim: int, ops: int = 30) -> list[bool | str]:
    """Rank 0 keeps writing 2**62 into the victim's stage counter (a thread, until the
    ops end) while every rank runs ``ops`` all_reduces: each is right, or the job fails
    naming the counter (never a sum read from a stage area the victim has not filled)."""
    import threading

    assert _all_reduce()  # the segment and the stage areas exist
    dist.barrier()
    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.wait(0.00002):
            _scribble(victim, "stage")

    writer = threading.Thread(target=keep_writing)
    if dist.get_rank() == 0:
        writer.start()
    try:
        return _outcomes(ops)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()


def completed_scribbled(victim: int, ops: int = 20) -> list[bool | str]:
    """Every rank runs ``ops`` all_reduces after rank 0 scribbled the victim's
    completed_seq: each is right, or the job fails naming the counter (never a wrong
    sum)."""
    assert _all_reduce()
    dist.barrier()
    if dist.get_rank() == 0:
        _scribble(victim, "completed_seq")
    return _outcomes(ops)


def failure_record_scribbled(word: int) -> str:
    """Rank 0 writes ``word`` into the group's failure record (the segment's header)
    while the others wait in an all_reduce it never joins: what they are told."""
    from pycomm import _C

    assert _all_reduce()
    dist.barrier()
    if dist.get_rank() == 0:
        offset = _C._control_word(dist.get_world_size(), 0, "abort_flag")
        ctypes.c_uint32.from_address(_segment_base() + offset).value = word
        dist.distributed_c10d._get_default_store().wait(["told/1", "told/2"])
        return ""
    try:
        _all_reduce()
        message = "no error"
    except dist.DistBackendError as e:
        message = str(e)
    dist.distributed_c10d._get_default_store().set(f"told/{dist.get_rank()}", "1")
    return message
