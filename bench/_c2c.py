"""Core-to-core readings that every benchmark table states, taken before and after it.

On small shared hosts the cache state flips every few seconds between fast (round trip
~60 ns, ~12 GB/s through a 256 KiB slot) and slow (~250-370 ns, ~2-3 GB/s), which moves
shared-memory results by several times; a table without the state it ran in cannot be
compared with another. The reading is pycomm's own probe
(csrc/core/communicator/core_probe.h, 0.1 s): a cache-line ping-pong and a 4-slot handoff
between two pinned threads.

    before = _c2c.reading()
    ...  # the benchmark
    after = _c2c.reading()
    print(_c2c.describe(before), "/", _c2c.describe(after))
"""

from __future__ import annotations

import os

# The two states seen on this VM: round trips around 60 ns (two cores sharing a cache)
# and 250-370 ns (cores on different cache domains). Readings between the bounds are
# neither, and are named so rather than forced into one of them (on 2026-11-30 the
# machine sat at 125-230 ns for hours).
FAST_ROUND_TRIP_NS = 100.0
SLOW_ROUND_TRIP_NS = 240.0


def state(round_trip_ns: float) -> str:
    """"fast" below FAST_ROUND_TRIP_NS, "slow" from SLOW_ROUND_TRIP_NS, else "between"."""
    if round_trip_ns < FAST_ROUND_TRIP_NS:
        return "fast"
    return "slow" if round_trip_ns >= SLOW_ROUND_TRIP_NS else "between"


def unavailable() -> str | None:
    """Why no reading can be taken here (this process may run on one CPU only), or None."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return f"this process may run on CPU {cpus} only; a core-to-core reading needs two"
    return None


def reading(budget_s: float = 0.1) -> dict | None:
    """One reading between the first two CPUs of this process's affinity set.

    Returns {"round_trip_ns", "handoff_gbs", "exchange_gbs", "cpus": (a, b),
    "state": "fast" | "slow"} (the handoff one way; the exchange per direction, both
    ways at once), or None where `unavailable()` gives a reason (describe(None) states
    it).

    Raises:
        RuntimeError: the probe's threads could not be pinned, or other work kept the
            two CPUs so busy that no batch finished within budget_s + 1 s.
    """
    if unavailable() is not None:
        return None
    from pycomm import _C  # compiled, no stub

    r = _C._probe_cores(-1, -1, budget_s)
    return {
        "round_trip_ns": r["round_trip_ns"],
        "handoff_gbs": r["handoff_gbs"],
        "exchange_gbs": r["exchange_gbs"],
        "cpus": (r["cpu_a"], r["cpu_b"]),
        "state": state(r["round_trip_ns"]),
    }


def describe(r: dict | None) -> str:
    """One line: "c2c: round trip 62 ns, 256 KiB-slot handoff 11.8 GB/s one way, 6.1 GB/s
    each way both at once (fast)" (a reading from before the exchange phase: one way only)."""
    if r is None:
        return f"c2c: no reading ({unavailable() or 'not taken'})"
    both = (f", {r['exchange_gbs']:.1f} GB/s each way both at once"
            if r.get("exchange_gbs") else "")
    return (
        f"c2c: round trip {r['round_trip_ns']:.0f} ns, "
        f"256 KiB-slot handoff {r['handoff_gbs']:.1f} GB/s one way{both} ({r['state']})"
    )
