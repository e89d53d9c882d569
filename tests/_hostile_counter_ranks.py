"""Rank functions for tests/test_hostile_counters.py: rank 0 writes 2**62 into a peer's
control word in the group's shared segment (a stray write, or a process of the same
user) and the ranks run two-shot all_reduces (3 ranks, 300_001 floats)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

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


def _word_address(victim: int, name: str, peer: int) -> int:
    from pycomm import _C

    offset = _C._control_word(dist.get_world_size(), victim, name, peer)
    return _segment_base() + offset


def _scribble(victim: int, counter: str) -> None:
    ctypes.c_uint64.from_address(_word_address(victim, counter, -1)).value = HUGE


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


def _outcomes_while_rank0_writes(address: Callable[[], int], ops: int) -> list[bool | str]:
    """Every rank runs ``ops`` all_reduces (see :func:`_outcomes`) while a thread of rank
    0 keeps writing 2**62 at ``address()`` (rank 0's mapping of the segment)."""
    import threading

    assert _all_reduce()  # the segment, its channels and stage areas exist
    dist.barrier()
    stop = threading.Event()

    def keep_writing() -> None:
        word = ctypes.c_uint64.from_address(address())
        while not stop.wait(0.00002):
            word.value = HUGE

    writer = threading.Thread(target=keep_writing)
    if dist.get_rank() == 0:
        writer.start()
    try:
        return _outcomes(ops)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()


def stage_scribbled(victim: int, ops: int = 30) -> list[bool | str]:
    """Rank 0 keeps writing 2**62 into the victim's stage counter while every rank runs
    ``ops`` all_reduces: each is right, or the job fails naming the counter (never a sum
    read from a stage area the victim has not filled)."""
    return _outcomes_while_rank0_writes(lambda: _word_address(victim, "stage", -1), ops)


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


def recv_after_p2p_head_scribbled(value: int) -> str:
    """Rank 0 writes ``value`` into rank 1's head of its send/recv channel to rank 0 (rank
    1 never sends), then receives from rank 1: what it is told. Rank 1 only waits."""
    store = dist.distributed_c10d._get_default_store()
    assert _all_reduce()  # the segment exists
    dist.barrier()
    if dist.get_rank() != 0:
        store.wait(["p2p/told"])
        return ""
    ctypes.c_uint64.from_address(_word_address(1, "p2p_head", 0)).value = value
    try:
        dist.recv(torch.empty(4), src=1)
        message = "no error"
    except dist.DistBackendError as e:
        message = str(e)
    store.set("p2p/told", "1")
    return message


def coll_counter_scribbled(victim: int, name: str, peer: int, ops: int = 30
                           ) -> list[bool | str]:
    """Rank 0 keeps writing 2**62 into the victim's ``name`` channel counter while every
    rank runs ``ops`` ring all_reduces (PYCOMM_ALGO=ring): each is right, or the job fails
    naming the counter."""
    return _outcomes_while_rank0_writes(lambda: _word_address(victim, name, peer), ops)


def descriptor_garbled(count: int) -> str:
    """Rank 0 writes a descriptor no rank could publish (kind 0xDEAD, ``count``) into rank
    1's record of its next call, while rank 1 is late to it: what ranks 0 and 2, waiting
    for it, are told (rank 1 then fails with the group)."""
    import threading
    import time

    assert _all_reduce()
    dist.barrier()
    rank = dist.get_rank()
    words = ctypes.c_uint64 * 16  # 4 descriptors of 4 words: seq, kind|dtype, count, op|root
    stop = threading.Event()

    def keep_writing(last: int) -> None:  # on rank 0, which maps the segment itself
        theirs = words.from_address(_word_address(1, "recent", -1))
        at = 4 * ((last + 1) % 4)
        while not stop.wait(0.0005):
            theirs[at + 1], theirs[at + 2], theirs[at + 3] = 0xDEAD << 32, count, 0
            theirs[at] = last + 1

    if rank == 0:  # rank 0's last seq (every rank's), read before it enters the next
        mine = words.from_address(_word_address(0, "recent", -1))
        last = max(mine[4 * i] for i in range(4))
    writer = threading.Thread(target=keep_writing, args=(last if rank == 0 else 0,))
    if rank == 0:
        writer.start()
    try:
        if rank == 1:
            time.sleep(0.5)
        _all_reduce()
        return "no error"
    except dist.DistBackendError as e:
        return str(e)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()


def _mixed_op(i: int) -> bool:
    """Op ``i`` of a mix that uses every kind of control word: the two-shot all_reduce
    (stage counters), a small all_reduce, an all_gather, a broadcast (the collective
    channels) and a ring of send/recv (the send/recv channels); whether it was right."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = i % 5
    if kind == 0:
        return _all_reduce()
    if kind == 1:
        y = torch.full((64,), float(rank + i))
        dist.all_reduce(y)
        return bool(torch.all(y == float(sum(range(world)) + world * i)))
    if kind == 2:
        parts = [torch.empty(1000) for _ in range(world)]
        dist.all_gather(parts, torch.full((1000,), float(rank)))
        return all(bool(torch.all(p == float(r))) for r, p in enumerate(parts))
    if kind == 3:
        y = torch.full((5000,), float(rank + 7))
        dist.broadcast(y, src=i % world)
        return bool(torch.all(y == float(i % world + 7)))
    got = torch.empty(100)
    ops = [dist.P2POp(dist.isend, torch.full((100,), float(rank)), (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return bool(torch.all(got == float((rank - 1) % world)))


def word_scribbled(name: str, victim: int, peer: int, value: int, ops: int = 25
                   ) -> list[bool | str]:
    """A thread of rank 0 keeps writing ``value`` into the victim's control word ``name``
    (of its channel to ``peer``, for a channel's counters) while every rank runs ``ops``
    of :func:`_mixed_op`: whether each was right, ending with the error that stopped
    them, if one did."""
    import threading

    for i in range(5):  # every region the mix uses exists
        assert _mixed_op(i)
    dist.barrier()
    stop = threading.Event()

    def keep_writing() -> None:  # rank 0's: the segment is mapped at its address there
        word = ctypes.c_uint64.from_address(_word_address(victim, name, peer))
        while not stop.wait(0.00002):
            word.value = value

    writer = threading.Thread(target=keep_writing)
    if dist.get_rank() == 0:
        writer.start()
    out: list[bool | str] = []
    try:
        for i in range(ops):
            out.append(_mixed_op(i))
    except dist.DistBackendError as e:
        out.append(str(e))
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
    return out
