"""The limit column: the busbw an op could reach if every byte its schedule must move
moved at the rate this machine sustains for that kind of byte, measured in the same job.

Over shared memory, on ordinary (private) tensors, a rank's bytes are of three kinds:

- **tensor bytes** T: read its input, write its output, each byte once, in its own
  memory: at the read-modify-write rate measured at this size with every rank running
  (:func:`time_local`; a core's cache up to a few MiB, DRAM beyond);
- **staged bytes** X: what a peer needs from this rank must first be written where the
  peer can see it (a private tensor is not), once: cache-resident slots, at the local
  rate of a cache-sized pass (MIN_TIMED_BYTES);
- **peer bytes** X: what this rank needs from the others, read once from where they
  staged it, at the c2c probe's core-to-core handoff rate (the better reading of the job;
  ranks sharing a core share it).

A core issues all three, so the least time is their sum. Each exchanged byte is staged
once and read once: that is the ring's traffic (pycomm's schedule from
``PYCOMM_DIRECT_BYTES``; below it the direct schedule moves as much at 2 ranks and more
at 4, and latency rules there anyway). So ``pycomm / limit`` is how close pycomm comes to
moving its least traffic at this machine's rates.

Least traffic per rank, S = the op's size (nccl-tests' S), w ranks:

| op | tensor T (read + write) | exchanged X (staged here, read by a peer) |
|---|---|---|
| all_reduce (in place) | S + S | 2 (w-1)/w S (reduce-scatter, then all-gather) |
| reduce_scatter (S = input) | S + S/w | (w-1)/w S |
| all_gather (S = output) | S/w + S | (w-1)/w S |
| all_to_all | S + S | (w-1)/w S |
| broadcast (a non-root) | S (write) | S |
| reduce (the root) | S + S | 2 (w-1)/w S, as all_reduce's reduce-scatter then gather to it |
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from bench._timing import busbw_factor

GB = 1e9
MIN_TIMED_BYTES = 1 << 20


def least_traffic(op: str, nbytes: int, world: int) -> tuple[float, float]:
    """(tensor bytes, exchanged bytes) of a rank for one op (module table); each
    exchanged byte is staged once and read once by a peer."""
    s, w = float(nbytes), world
    peers = (w - 1) / w * s
    model = {
        "all_reduce": (2 * s, 2 * peers),
        "reduce_scatter": (s + s / w, peers),
        "all_gather": (s / w + s, peers),
        "all_to_all": (2 * s, peers),
        "broadcast": (s, s),
        "reduce": (2 * s, 2 * peers),
    }
    return model[op]


def least_bytes(op: str, nbytes: int, world: int) -> float:
    """Every byte a rank reads or writes at least: tensor, staged and peer bytes."""
    tensor, exchanged = least_traffic(op, nbytes, world)
    return tensor + 2 * exchanged


def limit_seconds(op: str, nbytes: int, world: int, local_gbs: float, cache_gbs: float,
                  handoff_gbs: float | None, ranks_per_core: int = 1) -> float:
    """The least time of one op: its tensor bytes at ``local_gbs`` (bytes read plus
    written per second per rank at this size, every rank running), its staged bytes at
    ``cache_gbs`` (the same, cache-resident) and its peer bytes at ``handoff_gbs`` shared
    by ``ranks_per_core``. Without a handoff reading (one CPU), peer bytes at the cache
    rate."""
    tensor, exchanged = least_traffic(op, nbytes, world)
    peer_gbs = handoff_gbs / ranks_per_core if handoff_gbs else cache_gbs
    return (tensor / (local_gbs * GB) + exchanged / (cache_gbs * GB)
            + exchanged / (peer_gbs * GB))


def limit_busbw(op: str, nbytes: int, world: int, local_gbs: float, cache_gbs: float,
                handoff_gbs: float | None, ranks_per_core: int = 1) -> float:
    """The busbw of an op that took :func:`limit_seconds`."""
    seconds = limit_seconds(op, nbytes, world, local_gbs, cache_gbs, handoff_gbs,
                            ranks_per_core)
    return nbytes / seconds / GB * busbw_factor(op, world)


def ranks_per_core(world: int, cpus: int) -> int:
    return max(1, math.ceil(world / max(1, cpus)))


def best_handoff(readings: list[dict | None]) -> float | None:
    """The best core-to-core handoff GB/s among a job's c2c readings, or None."""
    rates = [r["handoff_gbs"] for r in readings if r]
    return max(rates) if rates else None


def timed_bytes(nbytes: int) -> int:
    """The buffer a pass at this sweep size times: the size itself, but at least
    MIN_TIMED_BYTES (below it a pass is shorter than the Python call that times it; it
    still fits a core's L2, as the smaller sizes do, so it is their cache level's rate)."""
    return max(nbytes, MIN_TIMED_BYTES) // 4 * 4


def time_local(nbytes: int, iters: int, group) -> list[float]:
    """Seconds per read-modify-write pass over a private buffer of ``timed_bytes(nbytes)``,
    every rank at once (a barrier before each pass): the rate of an op's tensor traffic
    at this size. The first pass faults the pages in and is not timed."""
    buf = torch.ones(timed_bytes(nbytes) // 4)
    times = []
    for i in range(iters + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        buf.mul_(1.0)
        if i:
            times.append(time.perf_counter() - start)
    return times


def time_locals(sizes: list[int], iters: int, group) -> dict[int, list[float]]:
    """:func:`time_local` at every size of the sweep (each cache level has its rate) and
    at MIN_TIMED_BYTES (the staged bytes' rate)."""
    wanted = sorted({*sizes, MIN_TIMED_BYTES})
    return {n: time_local(n, max(iters, 5), group) for n in wanted}


def time_one_core(sizes: list[int], iters: int, group) -> dict[int, float] | None:
    """Rank 0's read-modify-write GB/s at each size while the others wait in a barrier
    (one core busy): beside the all-ranks rate, how much running together costs."""
    out = None
    if dist.get_rank() == 0:
        out = {}
        for n in sorted({*sizes, MIN_TIMED_BYTES}):
            buf = torch.ones(timed_bytes(n) // 4)
            buf.mul_(1.0)
            times = []
            for _ in range(max(iters, 5)):
                start = time.perf_counter()
                buf.mul_(1.0)
                times.append(time.perf_counter() - start)
            out[n] = 2 * timed_bytes(n) / statistics.median(times) / GB
    dist.barrier(group=group)
    return out


def local_gbs(nbytes: int, per_rank: list[list[float]]) -> float:
    """Read-plus-write GB/s of one rank's pass when all run at once: the slowest rank's
    median pass over twice the buffer timed at this size."""
    slowest = [max(it) for it in zip(*per_rank, strict=True)]
    return 2 * timed_bytes(nbytes) / statistics.median(slowest) / GB
