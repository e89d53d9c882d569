"""Ranks of tests/test_wait_slice.py: a rank's time slice while it sleeps for a late peer,
and after the op (read from /proc/<pid>/task/<tid>/sched, which Linux >= 6.6 prints)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import torch
import torch.distributed as dist

LATE_S = 0.4  # how long the late rank keeps its peer waiting (asleep) in the op
SAMPLE_S = 0.005


class _SchedAttr(ctypes.Structure):  # struct sched_attr, SCHED_ATTR_SIZE_VER1
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def set_own_slice(ns: int) -> None:
    """The calling thread asks for a slice of `ns` (as a user's trainer might)."""
    sys_sched_setattr = 314  # x86-64; the test module skips elsewhere
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), nice=os.getpriority(os.PRIO_PROCESS, 0),
                      runtime=ns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(sys_sched_setattr, 0, ctypes.byref(attr), 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr")


def slice_of(tid: int) -> int:
    """The thread's current slice in ns (se.slice), -1 if the kernel does not say."""
    with open(f"/proc/self/task/{tid}/sched") as f:
        for line in f:
            if line.startswith("se.slice"):
                return int(float(line.split(":")[1]))
    return -1


def _all_reduce_sampled(late_rank: int) -> tuple[list[int], float]:
    """One all_reduce that `late_rank` enters LATE_S late; the other rank samples its
    calling thread's slice meanwhile. Returns the samples (empty on the late rank)."""
    tid, seen, stop = threading.get_native_id(), [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(slice_of(tid))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample)
    x = torch.ones(1024, dtype=torch.float64)
    dist.barrier()
    if dist.get_rank() == late_rank:
        time.sleep(LATE_S)
    else:
        sampler.start()
    dist.all_reduce(x)
    stop.set()
    if sampler.ident is not None:  # started: on the waiting rank only
        sampler.join()
    return seen, float(x[0])


def waits_and_slices(custom_ns: int) -> list[dict]:
    """Each rank waits once for the other: with the scheduler's slice, then (when
    custom_ns) with one this thread set itself. Per case: the waiting rank's slice
    before, the shortest seen while it waited, after; and the op's result."""
    tid, cases = threading.get_native_id(), []
    for late_rank, own in ((1, 0), (0, 0), (1, custom_ns), (0, custom_ns)):
        if own:
            set_own_slice(own)
        before = slice_of(tid)
        seen, value = _all_reduce_sampled(late_rank)
        cases.append({"waiting": dist.get_rank() != late_rank, "own": own, "before": before,
                      "least_seen": min(seen) if seen else None, "after": slice_of(tid),
                      "samples": len(seen), "value": value})
    return cases


def engine_thread_slices() -> list[int]:
    """Every thread's slice after a send/recv pair (the engine's thread has run)."""
    x = torch.full((8,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    else:
        dist.recv(x, 0)
        dist.send(x, 0)
    return [slice_of(int(t)) for t in os.listdir("/proc/self/task")]
