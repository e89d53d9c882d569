"""Every wait that sleeps on a doorbell asks for the short time slice (wait_slice.h).

A sleeping rank woken by its peer otherwise queues behind every busy thread on its core
(10-20 ms beside four busy loops): the collectives' Waiter, the send/recv engine and the
CUDA ring's host waits all sleep on futexes, and a new one must not forget. Read from the
sources, so it holds on any kernel and without a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
FUTEX_ITSELF = {"core/base/futex.h", "core/base/futex.cc"}


def sleeping_files() -> list[Path]:
    files = [p for p in CSRC.rglob("*") if p.suffix in {".h", ".cc", ".cu", ".cuh"}]
    return [p for p in files if str(p.relative_to(CSRC)) not in FUTEX_ITSELF
            and re.search(r"\bfutex_wait\(", p.read_text())]


def test_the_sleeping_waits_are_found():
    names = {str(p.relative_to(CSRC)) for p in sleeping_files()}
    assert {"core/communicator/waiter.h", "core/transport/p2p_engine.cc",
            "cuda/host/ring_sync.cc"} <= names, names


def test_every_file_that_sleeps_on_a_futex_asks_for_the_short_slice():
    asks = re.compile(r"\bShortSlice\b|\bshorten_slice_for_wait\(")
    missing = [str(p.relative_to(CSRC)) for p in sleeping_files()
               if not asks.search(p.read_text())]
    assert not missing, (f"{missing} sleep on a futex without a ShortSlice: a "
                         "rank woken there waits behind the core's busy threads")
