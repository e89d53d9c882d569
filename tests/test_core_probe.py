"""The core-to-core probe (csrc/core/communicator/core_probe.h, `_C._probe_cores`) and the
reading benchmark tables state (bench/_c2c.py): finite numbers within a time bound, eager
errors that name the CPU, and the fast/between/slow thresholds on synthetic readings."""

from __future__ import annotations

import math
import os
import re
import threading
import time

import pytest

from bench import _c2c

ALLOWED = sorted(os.sched_getaffinity(0))
TWO_CPUS = len(ALLOWED) >= 2


# What the probe says when other work keeps the two CPUs from running its threads
# within budget_s + 1 s (a loaded machine): it refuses rather than report a reading of
# the load.
BUSY = r"other work keeps those CPUs busy|the partner thread was not pinned"


def _busy_refusal(probe):
    """``probe()``, or None where it refused because the CPUs were busy (and said so)."""
    try:
        return probe()
    except RuntimeError as e:
        assert re.search(BUSY, str(e)), str(e)
        return None


@pytest.fixture
def C(require_pycomm):
    from pycomm import _C

    return _C


def test_probe_gives_positive_finite_numbers_within_the_time_bound(C):
    if not TWO_CPUS:  # one CPU: the probe refuses, and the bench reading is None
        with pytest.raises(ValueError, match="needs two CPUs"):
            C._probe_cores()
        assert _c2c.reading() is None
        return
    for _attempt in range(3):  # a busy machine may refuse every one: see _busy_refusal
        t0 = time.monotonic()
        r = _busy_refusal(lambda: C._probe_cores(budget_s=0.1))
        took = time.monotonic() - t0
        # its hard deadline is the budget + 1 s, reading or refusal
        assert took < 2.0, f"a 0.1 s probe took {took:.2f} s"
        if r is not None:
            break
    else:
        return
    assert math.isfinite(r["round_trip_ns"]) and r["round_trip_ns"] > 0
    assert math.isfinite(r["handoff_gbs"]) and r["handoff_gbs"] > 0
    assert math.isfinite(r["exchange_gbs"]) and r["exchange_gbs"] > 0
    assert (r["cpu_a"], r["cpu_b"]) == (ALLOWED[0], ALLOWED[1])  # -1: the first two


def test_probe_releases_the_gil(C):
    if not TWO_CPUS:
        return  # nothing to run without a GIL: covered by the test above
    probe = threading.Thread(target=C._probe_cores, kwargs={"budget_s": 0.2})
    probe.start()
    spins = 0
    while probe.is_alive():
        spins += 1
    probe.join()
    assert spins > 100, "the main thread hardly ran while the probe did"


def test_same_cpu_twice_raises_value_error_naming_it(C):
    cpu = ALLOWED[0]
    with pytest.raises(ValueError, match=rf"both cpu {cpu}\b.*allowed: "):
        C._probe_cores(cpu, cpu)


def test_cpu_outside_the_affinity_set_is_named_with_the_set(C):
    cpu = ALLOWED[-1] + 1
    with pytest.raises(ValueError, match=rf"cpu_b is cpu {cpu}\b.*allowed: {ALLOWED[0]}"):
        C._probe_cores(ALLOWED[0], cpu)
    with pytest.raises(ValueError, match=r"cpu -2 is not a CPU"):
        C._probe_cores(-2, ALLOWED[0])


@pytest.mark.parametrize("budget", [0.0, -1.0, math.nan, 61.0])
def test_budget_out_of_range_raises(C, budget):
    with pytest.raises(ValueError, match="budget_s"):
        C._probe_cores(budget_s=budget)


def test_reading_and_its_line(C):
    r = next((r for r in (_busy_refusal(_c2c.reading) for _ in range(3)) if r is not None),
             None)
    if r is None and TWO_CPUS:
        return  # refused three times, each for being busy (checked in _busy_refusal)
    if not TWO_CPUS:
        assert r is None and "needs two" in _c2c.describe(r)
        return
    assert set(r) == {"round_trip_ns", "handoff_gbs", "exchange_gbs", "cpus", "state"}
    assert r["state"] == _c2c.state(r["round_trip_ns"])
    assert r["cpus"] == (ALLOWED[0], ALLOWED[1])
    line = (r"c2c: round trip \d+ ns, 256 KiB-slot handoff \d+\.\d GB/s one way, \d+\.\d GB/s "
            r"each way both at once \((fast|between|slow)\)")
    assert re.fullmatch(line, _c2c.describe(r))


@pytest.mark.parametrize(
    ("round_trip_ns", "state"),
    [(55.0, "fast"), (99.9, "fast"), (100.0, "between"), (180.0, "between"),
     (239.9, "between"), (240.0, "slow"), (370.0, "slow")],
)
def test_state_threshold(round_trip_ns, state):
    assert _c2c.state(round_trip_ns) == state


def test_describe_synthetic_readings():
    fast = {"round_trip_ns": 62.3, "handoff_gbs": 11.84, "cpus": (0, 1), "state": "fast"}
    slow = {"round_trip_ns": 301.0, "handoff_gbs": 1.74, "cpus": (0, 1), "state": "slow"}
    assert _c2c.describe(fast) == ("c2c: round trip 62 ns, 256 KiB-slot handoff 11.8 GB/s one "
                                   "way (fast)")  # a reading from before the exchange phase
    slow["exchange_gbs"] = 0.86
    assert _c2c.describe(slow) == ("c2c: round trip 301 ns, 256 KiB-slot handoff 1.7 GB/s one "
                                   "way, 0.9 GB/s each way both at once (slow)")


def test_one_cpu_gives_none_and_a_reason(monkeypatch):
    monkeypatch.setattr(_c2c.os, "sched_getaffinity", lambda pid: {3})
    assert _c2c.reading() is None  # returns before touching the extension
    assert _c2c.describe(None) == (
        "c2c: no reading (this process may run on CPU [3] only; a core-to-core reading needs two)"
    )
