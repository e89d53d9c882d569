"""The limit column: the busbw an op could reach if it moved only its least traffic per
rank, each kind of byte at the best rate this machine sustained for it in the same job.

Over shared memory, on ordinary (private) tensors, a rank moves two kinds of bytes:

- **tensor bytes** T: read its input, write its output, each byte once, in its own
  memory, at the read-modify-write rate measured at this size with every rank running
  (:func:`time_local`: a core's cache up to a few MiB, DRAM beyond);
- **exchanged bytes** X: what it needs from the others' cores (a peer's part of its
  chunk, a reduced chunk it gathers), at the c2c probe's core-to-core handoff rate (the
  better reading of the job; ranks sharing a core share it). A peer must stage them
  where this rank can see them (a private tensor is not), but those writes stay in
  cache-resident slots and overlap the stream, as the ring's pipelining does.

The two can overlap (a core streams its tensor while lines arrive from the other), so
the least time is the larger of T / local rate and X / handoff rate: a bound no schedule
beats at these rates, not a model of one. ``pycomm / limit`` is how close pycomm comes.

Least traffic per rank, S = the op's size (nccl-tests' S), w ranks:

| op | tensor T (read + write) | exchanged X (from other cores) |
|---|---|---|
| all_reduce (in place) | S + S | 2 (w-1)/w S (reduce-scatter, then all-gather) |
| reduce_scatter (S = input) | S + S/w | (w-1)/w S |
| all_gather (S = output) | S/w + S | (w-1)/w S |
| all_to_all | S + S | (w-1)/w S |
| broadcast (a non-root) | S (write) | S |
| reduce (the root) | S + S | 2 (w-1)/w S, as all_reduce's reduce-scatter then gather to it |

**Arena tensors** (``pycomm.empty``, the ``pycomm-registered`` family) are read in place:
each rank reads and writes its part of every rank's buffer, so nothing is staged and no
byte has to cross to another core (a loop over one buffer keeps each part in the cache
of the rank that reduces it). Their least time is every byte a rank touches at the local
rate (``staged=False``):

| op, in place | read + written per rank |
|---|---|
| all_reduce | S + S (its n-th of every buffer, the result into every buffer) |
| reduce_scatter | S + S/w |
| all_gather | S + S |
| all_to_all | S + S |
| broadcast (a non-root) | S + S (the root's buffer into its own) |
| reduce | S + S/w (its n-th of every buffer into the root's) |

Without it their busbw passed the staged limit 1.1-1.8x at 1-16 MB (2 ranks): it is not
a limit for them.
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
    """(tensor bytes, exchanged bytes) of a rank for one op (module table)."""
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


def in_place_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes a rank reads plus writes when every buffer is read in place (module table)."""
    s, w = float(nbytes), world
    return {"all_reduce": 2 * s, "reduce_scatter": s + s / w, "all_gather": 2 * s,
            "all_to_all": 2 * s, "broadcast": 2 * s, "reduce": s + s / w}[op]


def least_bytes(op: str, nbytes: int, world: int) -> float:
    """Every byte a rank reads or writes at least: its tensor's and those it receives."""
    return sum(least_traffic(op, nbytes, world))


def tensor_seconds(touched: float, local_gbs: float, ranks_per_core: int = 1,
                   one_core_gbs: float | None = None) -> float:
    """The least time of a rank's own bytes (``touched``, read plus written) at
    ``local_gbs``. Where ranks share a core, the core does all their bytes, at best at the
    rate one core gets alone (``one_core_gbs``, the others idle): ranks sharing a core
    often run their timed passes one after the other, each at that rate, so the per-rank
    rate alone would count a core per rank."""
    seconds = touched / (local_gbs * GB)
    if one_core_gbs and ranks_per_core > 1:
        seconds = max(seconds, ranks_per_core * touched / (one_core_gbs * GB))
    return seconds


def limit_seconds(op: str, nbytes: int, world: int, local_gbs: float, cache_gbs: float,
                  handoff_gbs: float | None, ranks_per_core: int = 1,
                  staged: bool = True, one_core_gbs: float | None = None) -> float:
    """The least time of one op: the larger of its tensor bytes at ``local_gbs`` (bytes
    read plus written per second per rank at this size, every rank running; see
    :func:`tensor_seconds` for ranks sharing a core) and its exchanged bytes at
    ``handoff_gbs`` shared by ``ranks_per_core``. Without a handoff reading (one CPU: the
    ranks share its caches), the exchanged bytes at ``cache_gbs``, the local rate of a
    cache-resident pass. Not ``staged`` (arena tensors, read in place): every byte it
    touches, as tensor bytes."""
    if not staged:
        return tensor_seconds(in_place_bytes(op, nbytes, world), local_gbs, ranks_per_core,
                              one_core_gbs)
    tensor, exchanged = least_traffic(op, nbytes, world)
    peer_gbs = handoff_gbs / ranks_per_core if handoff_gbs else cache_gbs
    return max(tensor_seconds(tensor, local_gbs, ranks_per_core, one_core_gbs),
               exchanged / (peer_gbs * GB))


def limit_busbw(op: str, nbytes: int, world: int, local_gbs: float, cache_gbs: float,
                handoff_gbs: float | None, ranks_per_core: int = 1,
                staged: bool = True, one_core_gbs: float | None = None) -> float:
    """The busbw of an op that took :func:`limit_seconds`."""
    seconds = limit_seconds(op, nbytes, world, local_gbs, cache_gbs, handoff_gbs,
                            ranks_per_core, staged, one_core_gbs)
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


def rmw_pass(buf: torch.Tensor) -> None:
    """One read-modify-write pass over ``buf``: the unit of an op's tensor traffic that the
    limit's local rate is measured in (time_local, time_one_core,
    records.investigations.limit_states)."""
    buf.mul_(1.0)


def time_local(nbytes: int, iters: int, group) -> list[float]:
    """Seconds per read-modify-write pass over a private buffer of ``timed_bytes(nbytes)``,
    every rank at once (a barrier before each pass): the rate of an op's tensor traffic
    at this size. The first pass faults the pages in and is not timed."""
    buf = torch.ones(timed_bytes(nbytes) // 4)
    times = []
    for i in range(iters + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        rmw_pass(buf)
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
            rmw_pass(buf)
            times = []
            for _ in range(max(iters, 5)):
                start = time.perf_counter()
                rmw_pass(buf)
                times.append(time.perf_counter() - start)
            out[n] = 2 * timed_bytes(n) / statistics.median(times) / GB
    dist.barrier(group=group)
    return out


def limits_of_run(limit: dict, ops_sizes: list[tuple[str, int]], world: int,
                  staged: bool = True) -> dict[tuple[str, int], float]:
    """The limit busbw at each (op, bytes) from a run's measured rates (its JSON's
    ``limit``), by today's model: a summary recomputes it from the raw files. A row's
    bytes may be rounded down from its sweep size; the rate timed at the smallest timed
    size that holds it counts."""
    local = {int(n): v for n, v in limit["local_gbs"].items()}
    one_core = {int(n): v for n, v in (limit.get("local_gbs_one_core") or {}).items()}
    timed = sorted(local)
    out = {}
    for op, n in ops_sizes:
        at = next((t for t in timed if t >= n), timed[-1])
        out[(op, n)] = limit_busbw(op, n, world, local[at], limit["cache_gbs"],
                                   limit.get("handoff_gbs"), limit.get("ranks_per_core", 1),
                                   staged, one_core.get(at))
    return out


def local_gbs(nbytes: int, per_rank: list[list[float]]) -> float:
    """Read-plus-write GB/s of one rank's pass when all run at once: the slowest rank's
    median pass over twice the buffer timed at this size."""
    slowest = [max(it) for it in zip(*per_rank, strict=True)]
    return 2 * timed_bytes(nbytes) / statistics.median(slowest) / GB
