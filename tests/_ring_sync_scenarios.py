"""What each process runs in tests/test_cuda_ring_sync.py: the CUDA ring's host protocol
(``pycomm._C._RingSync``: the same plans and waits as the GPU path, with no device work)
over a real shared-memory segment and a real TCPStore.

``serve`` runs a list of cases in one process; each case gets a fresh store prefix, so
its ring (and its abort record) is its own. A case returns a dict: what it saw, how long
it took. Errors a case expects are caught and returned as text; anything else comes
back as ``{"raised": ...}``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def _ring(store: Any, rank: int, size: int, timeout_s: float = 60.0, slots: int = 4) -> Any:
    from pycomm import _C  # type: ignore[attr-defined]

    return _C._RingSync(store, rank, size, slots=slots, timeout_s=timeout_s)


def _timed(call: Callable[[], Any]) -> dict:
    """Run ``call``; its error text (or None) and the seconds it took."""
    start = time.monotonic()
    try:
        value = call()
        return {"error": None, "value": value, "elapsed": time.monotonic() - start}
    except Exception as exc:  # the text is what the test checks
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - start}


# ------------------------------------------------------------------------------ cases


def agreeing_ops(store: Any, rank: int, size: int) -> dict:
    """Every kind, several roots, small chunks (many steps) over 2 slots: no false alarm."""
    ring = _ring(store, rank, size, timeout_s=60.0, slots=2)
    try:
        def walk_all() -> list[int]:
            seqs = []
            for count in (0, 1, 37):
                seqs.append(ring.walk("all_reduce", count, chunk_elems=3))
                seqs.append(ring.walk("reduce_scatter", count, op="max", chunk_elems=4))
                seqs.append(ring.walk("all_gather", count, dtype="int64", op="none",
                                      chunk_elems=5))
                for root in range(size):
                    seqs.append(ring.walk("broadcast", count, dtype="bfloat16", op="none",
                                          root=root, chunk_elems=2))
            return seqs

        out = _timed(walk_all)
        out["failed_by"] = ring.failed_by()
        out["drained"] = ring.drain(30.0)
        return out
    finally:
        ring.close()


def disagreeing_call(store: Any, rank: int, size: int, calls: list[dict],
                     agreed_first: int = 0) -> dict:
    """Rank r walks ``calls[r]`` after ``agreed_first`` all_reduces every rank agrees on."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    try:
        for _ in range(agreed_first):
            ring.walk("all_reduce", 16, chunk_elems=4)
        return _timed(lambda: ring.walk(**calls[rank]))
    finally:
        ring.close()


def runs_ahead_then_disagrees(store: Any, rank: int, size: int) -> dict:
    """Rank 1 runs five broadcasts from itself (it never waits: 8 slots) before rank 0
    arrives with an all_reduce; by then rank 1's history no longer holds seq 1, so only
    the tag of the window slot rank 0 reads can tell. Rank 1's next op must raise too."""
    ring = _ring(store, rank, size, timeout_s=60.0, slots=8)
    try:
        if rank == 1:
            for _ in range(5):
                ring.walk("broadcast", 1, op="none", root=1)
            time.sleep(1.0)
            return _timed(lambda: ring.walk("broadcast", 1, op="none", root=1))
        time.sleep(0.5)
        return _timed(lambda: ring.walk("all_reduce", 1))
    finally:
        ring.close()


def abort_while_peer_waits(store: Any, rank: int, size: int) -> dict:
    """Rank 0 aborts; the others wait for a step rank 0 never posts."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    try:
        if rank == 0:
            time.sleep(0.5)
            ring.abort("pycomm: rank 0 aborted the process group (test)")
            return {"error": None, "elapsed": 0.0}
        return _timed(lambda: ring.begin_and_wait("all_reduce", 8, step=0))
    finally:
        ring.close()


def peer_never_posts(store: Any, rank: int, size: int, enters: bool) -> dict:
    """Rank 0 waits 1 s for rank 1 to post step 0 of seq 1. Rank 1 enters the call (or
    not) but posts nothing, then looks at the abort record rank 0's timeout left."""
    ring = _ring(store, rank, size, timeout_s=1.0)
    try:
        if rank == 0:
            return _timed(lambda: ring.begin_and_wait("all_reduce", 8, step=0))
        if enters:
            ring.begin_and_wait("all_reduce", 8)
        time.sleep(2.5)
        return {"error": None, "failed_by": ring.failed_by(),
                "abort_message": ring.abort_message()}
    finally:
        ring.close()


def peer_leaves(store: Any, rank: int, size: int) -> dict:
    """Rank 1 destroys its ring while rank 0 waits for its step."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    try:
        if rank == 0:
            return _timed(lambda: ring.begin_and_wait("all_reduce", 8, step=0))
        time.sleep(0.5)
        return {"error": None}
    finally:
        ring.close()


def peer_killed(store: Any, rank: int, size: int, victim: int) -> dict:
    """``victim`` is killed (SIGKILL: no cleanup) while rank 0 waits for its
    predecessor's step; then rank 0's teardown must not wait for the dead rank."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    if rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if rank == 0:
            out = _timed(lambda: ring.begin_and_wait("all_reduce", 8, step=0))
            start = time.monotonic()
            out["drained"] = ring.drain(30.0)
            out["drain_s"] = time.monotonic() - start
            return out
        return _timed(lambda: ring.begin_and_wait("all_reduce", 8, step=0))
    finally:
        ring.close()


def teardown_waits_for_peer(store: Any, rank: int, size: int) -> dict:
    """Rank 0 drains at once; rank 1 only after 2 s: rank 0 gives up after its own
    bound (1 s) the first time, and sees rank 1 drained the second time."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    try:
        if rank == 0:
            first = _timed(lambda: ring.drain(1.0))
            second = _timed(lambda: ring.drain(30.0))
            return {"error": None, "first": first, "second": second}
        time.sleep(2.0)
        return _timed(lambda: ring.drain(30.0))
    finally:
        ring.close()


def teardown_hurries_when_failed(store: Any, rank: int, size: int) -> dict:
    """The job failed (rank 1 aborted) and rank 1 never drains: rank 0's teardown gives
    up within about a second although its bound is 60 s."""
    ring = _ring(store, rank, size, timeout_s=60.0)
    try:
        if rank == 1:
            ring.abort("pycomm: rank 1 failed (test)")
            time.sleep(4.0)
            return {"error": None}
        time.sleep(0.3)
        return _timed(lambda: ring.drain(60.0))
    finally:
        ring.close()


def concurrent_aborts(store: Any, rank: int, size: int, rounds: int) -> dict:
    """Every rank records a long, distinct reason at the same moment, ``rounds`` times:
    the record must always be one rank's whole text, attributed to that rank."""
    bad = []
    for i in range(rounds):
        from torch.distributed import PrefixStore

        ring = _ring(PrefixStore(f"round{i}", store), rank, size)
        try:
            store.add(f"go{i}", 1)
            while int(store.add(f"go{i}", 0)) < size:
                pass
            ring.abort(f"<rank {rank}>" + f"{rank}" * 900 + "<end>")
            by = ring.failed_by()
            text = ring.abort_message()
            want = f"<rank {by}>" + f"{by}" * 900 + "<end>"
            if text != want:
                bad.append(f"round {i}: failed_by {by} but the record says {text[:40]!r}...")
            store.add(f"done{i}", 1)  # keep the ring until every rank has read it
            while int(store.add(f"done{i}", 0)) < size:
                time.sleep(0.001)
        finally:
            ring.close()
    return {"error": None, "bad": bad}


# ----------------------------------------------------------------------------- runner


def serve(conn: Connection, rank: int, size: int, port: int,
          cases: list[tuple[str, dict]]) -> None:
    """Join the parent's store and run every case in order, sending one dict per case."""
    import torch.distributed as dist

    import pycomm  # noqa: F401  (loads the extension the test built)

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    for i, (name, kwargs) in enumerate(cases):
        try:
            result = globals()[name](dist.PrefixStore(f"case{i}", store), rank, size, **kwargs)
        except BaseException as exc:  # reported to the parent
            result = {"raised": f"{type(exc).__name__}: {exc}"}
        conn.send(result)
    conn.close()
