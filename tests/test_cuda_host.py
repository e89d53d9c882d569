"""The ring schedule and the CUDA path's host-side logic, tested without a GPU.

The GPU and the CPU path both walk the steps of ``plan_ring`` (the CPU's rings and
chains are its walk over shared-memory channels); here every rank's plan is walked by
the host simulator under the executor's ordering rules (read a slot only once its writer
posted it, rewrite a slot only once the reader has read it, and find the chunk where in
the message the reader expects it, as the CPU receiver checks), in many interleavings,
and checked against float64 references. The IPC handle format is round-tripped and its
errors checked. None of this needs CUDA, so it runs in every CI.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests._errors import error_message

pytestmark = pytest.mark.usefixtures("require_pycomm")  # fails, saying why, without it
try:
    from pycomm import _C  # type: ignore[attr-defined]
except ImportError:  # every test then fails in require_pycomm (a named skip on gloo)
    _C = None

KINDS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


def _inputs(kind: str, n: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    per_rank = count * n if kind == "reduce_scatter" else count
    # Integers in float64: sums are exact, so any misrouted chunk shows.
    return [rng.integers(-1000, 1000, per_rank).astype(np.float64) for _ in range(n)]


def _expected(kind: str, inputs: list[np.ndarray], count: int, root: int) -> list[np.ndarray]:
    n = len(inputs)
    total = np.sum(inputs, axis=0)
    if kind == "all_reduce":
        return [total] * n
    if kind == "reduce_scatter":
        return [total[r * count:(r + 1) * count] for r in range(n)]
    if kind == "all_gather":
        return [np.concatenate(inputs)] * n
    if kind == "reduce":  # the root's output; the others' are never written
        return [total if r == root else np.zeros(count) for r in range(n)]
    return [inputs[root]] * n


CASES = list(itertools.product(
    KINDS, [1, 2, 3, 4, 5], [0, 1, 7, 64, 1001], [1, 16, 300], [2, 3, 4]))


@pytest.mark.parametrize("kind,n,count,chunk,slots", CASES)
def test_simulated_ring_matches_reference(kind, n, count, chunk, slots):
    rng = np.random.default_rng(n * 1000 + count)
    inputs = _inputs(kind, n, count, rng)
    root = (n - 1) // 2
    for seed in range(3):  # three interleavings of the ranks
        outputs, _, _ = _C._ring_simulate(kind, [x.tolist() for x in inputs], count, root,
                                          chunk, slots, seed)
        expected = _expected(kind, inputs, count, root)
        for r, (got, want) in enumerate(zip(outputs, expected, strict=True)):
            np.testing.assert_array_equal(np.array(got), want, err_msg=f"{kind} rank {r}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_plans_the_same_number_of_steps_within_the_chunk(kind):
    for n, count, chunk in [(4, 1000, 64), (3, 10, 4), (5, 3, 100)]:
        plans = [_C._ring_plan(kind, count, r, n, root=1, chunk_elems=chunk) for r in range(n)]
        assert len({len(p) for p in plans}) == 1
        assert max(s["count"] for p in plans for s in p) <= chunk


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunk_is_read_where_its_writer_put_it_in_the_message(kind):
    """Each step that reads the predecessor's window names the same place in the message
    as the predecessor's step that wrote it (the CPU receiver refuses a chunk elsewhere)."""
    for n, count, chunk in [(4, 1000, 64), (3, 10, 4), (5, 3, 100), (2, 7, 2)]:
        plans = [_C._ring_plan(kind, count, r, n, root=1, chunk_elems=chunk) for r in range(n)]
        for r, plan in enumerate(plans):
            prev = plans[(r - 1) % n]
            for s in plan:
                if s["reads_prev"]:
                    wrote = prev[s["prev_step"]]
                    assert wrote["writes_window"], (kind, r, s)
                    assert (wrote["msg_offset"], wrote["count"]) == (s["msg_offset"], s["count"])


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_all_reduce_moves_the_ring_optimal_bytes(n):
    """Each rank reads 2 (n - 1) / n of the tensor from its predecessor: the bandwidth
    bound of any all-reduce, which is why the ring is used for large messages."""
    count = 8 * 1024 * n
    for r in range(n):
        plan = _C._ring_plan("all_reduce", count, r, n, chunk_elems=1024)
        read = sum(s["count"] for s in plan if s["reads_prev"])
        assert read == 2 * (n - 1) * count // n


def test_slot_reuse_is_checked_by_the_simulator():
    """One slot cannot hold a chunk until the reader has it: with the ordering rules the
    simulator never blocks forever, and it reports rank and step if a plan would."""
    outputs, steps, max_waits = _C._ring_simulate(
        "all_reduce", [[1.0] * 64, [2.0] * 64], 64, 0, 4, 2, 7)
    assert steps > 16 and max_waits >= 1  # the ranks did wait on each other
    assert outputs[0] == [3.0] * 64


def test_bad_plan_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="broadcast root 5 is not a rank of 4"):
        _C._ring_plan("broadcast", 10, 0, 4, root=5, chunk_elems=4)
    with pytest.raises(ValueError, match="reduce root -1 is not a rank of 4"):
        _C._ring_plan("reduce", 10, 0, 4, root=-1, chunk_elems=4)
    with pytest.raises(ValueError, match="no CUDA ring for 'all_to_all'"):
        _C._ring_plan("all_to_all", 10, 0, 4, chunk_elems=4)


@pytest.mark.parametrize("message,n", [(0, 2), (100, 2), (1 << 20, 4), (1 << 30, 8)])
def test_chunk_bytes_are_vector_aligned_and_bounded(message, n):
    got = _C._ring_chunk_bytes(message, n, 256 << 10, 4 << 20, 4)
    assert got % 16 == 0
    assert 256 << 10 <= got <= 4 << 20


def _info(rank: int = 1, slots: int = 2) -> dict:
    blob = bytes(range(64))
    return {"rank": rank, "device": 0, "bus": "0000:3b:00.0", "slot_bytes": 4 << 20,
            "slots": slots, "window": blob, "ready": [blob[::-1]] * slots,
            "consumed": [bytes(64)] * slots}


def test_ipc_handles_round_trip():
    info = _info()
    assert _C._ipc_decode(_C._ipc_encode(info), 1) == info


@pytest.mark.parametrize("mangle,message", [
    (lambda t: t.replace("pycomm-ipc/1", "pycomm-ipc/0"), "starts with 'pycomm-ipc/0'"),
    (lambda t: t.replace(" slots=2", ""), "field slots is missing"),
    (lambda t: t.replace("window=00", "window="), "window has 126 hex digits"),
    (lambda t: t.replace("window=00", "window=zz"), "not hex"),
    (lambda t: t.replace("rank=1", "rank=3"), "it says rank 3"),
])
def test_malformed_ipc_handles_name_the_rank_and_the_field(mangle, message):
    text = mangle(_C._ipc_encode(_info()))
    msg = error_message(lambda: _C._ipc_decode(text, 1), (RuntimeError,))
    assert "published by rank 1" in msg and message in msg


def test_ipc_peer_with_another_layout_is_refused():
    msg = error_message(lambda: _C._ipc_check_peer(_info(rank=0, slots=2), _info(rank=1, slots=3)),
                        (RuntimeError,))
    assert "rank 1's CUDA window has 3 slots" in msg and "rank 0's has 2" in msg
