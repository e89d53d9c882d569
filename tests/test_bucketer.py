"""pycomm.plan_buckets, pycomm.Bucketer and pycomm.Arena in one process."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pycomm
from pycomm import Arena, Bucketer, plan_buckets

sizes = st.lists(st.integers(min_value=0, max_value=5000), max_size=40)
caps = st.integers(min_value=1, max_value=6000)


@given(sizes, caps, caps)
def test_plan_covers_every_item_once_in_order_within_caps(item_bytes, cap, first_cap):
    plan = plan_buckets(item_bytes, cap, first_cap)
    assert [i for bucket in plan for i in bucket] == list(range(len(item_bytes)))
    for k, bucket in enumerate(plan):
        assert len(bucket) > 0
        total = sum(item_bytes[i] for i in bucket)
        limit = first_cap if k == 0 else cap
        assert total <= limit or len(bucket) == 1, f"bucket {k} holds {total} B > {limit}"


@given(sizes, caps)
def test_plan_buckets_are_maximal(item_bytes, cap):
    """A bucket closes only when the next item would not fit (DDP fills to the cap)."""
    plan = plan_buckets(item_bytes, cap)
    for bucket, following in itertools.pairwise(plan):
        total = sum(item_bytes[i] for i in bucket)
        assert total + item_bytes[following[0]] > cap


def test_plan_rejects_a_zero_cap():
    with pytest.raises(ValueError, match="caps must be > 0"):
        plan_buckets([4, 4], 0)


class FakeWork:
    def __init__(self, log: list, k: int):
        self.log, self.k = log, k

    def wait(self):
        self.log.append(("wait", self.k))


@given(st.permutations(range(10)))
def test_buckets_launch_in_order_whatever_the_ready_order(ready_order):
    log: list = []
    bucketer = Bucketer([range(0, 3), range(3, 4), range(4, 10)],
                        lambda k: log.append(("launch", k)) or FakeWork(log, k))
    for item in ready_order:
        bucketer.mark_ready(item)
    assert [k for what, k in log if what == "launch"] == [0, 1, 2]
    bucketer.wait()
    assert [k for what, k in log if what == "wait"] == [0, 1, 2]
    assert bucketer.collectives_issued == 3


def test_a_bucket_launches_as_soon_as_it_and_its_predecessors_are_full():
    launched: list[int] = []
    bucketer = Bucketer([[0, 1], [2]], lambda k: launched.append(k) or FakeWork([], k))
    bucketer.mark_ready(2)
    assert launched == []  # bucket 1 is full, but bucket 0 must go first
    bucketer.mark_ready(0)
    assert launched == []
    bucketer.mark_ready(1)
    assert launched == [0, 1]


def test_marking_twice_and_waiting_early_are_errors():
    bucketer = Bucketer([[0, 1], [2]], lambda k: FakeWork([], k))
    bucketer.mark_ready(0)
    with pytest.raises(RuntimeError, match="item 0 was marked ready twice"):
        bucketer.mark_ready(0)
    with pytest.raises(RuntimeError, match=r"items not ready: \[1, 2\]"):
        bucketer.wait()
    with pytest.raises(RuntimeError, match="item 7 is not in any bucket"):
        bucketer.mark_ready(7)
    bucketer.reset()
    bucketer.mark_ready(0)  # a new round starts clean


@pytest.mark.parametrize("shared", [False, True])
def test_arena_views_are_aligned_disjoint_and_counted(shared, require_pycomm):
    arena = Arena(1000, torch.float32, shared=shared)
    a, b, c = arena.allocate(3), arena.allocate(17), arena.allocate(0)
    assert pycomm.in_arena(arena.buffer) == shared
    for view in (a, b, c):
        assert view.data_ptr() % 64 == 0
    assert arena.offset_of(b) == 16 and arena.offset_of(c) == 48
    assert torch.count_nonzero(arena.buffer) == 0, "an arena starts zeroed"
    assert arena.stats() == {"reserved_bytes": 4000, "live_bytes": 192, "peak_bytes": 192,
                             "allocations": 3}
    arena.reset()
    assert arena.stats()["live_bytes"] == 0 and arena.stats()["peak_bytes"] == 192


def test_arena_refuses_to_overflow_and_foreign_tensors():
    arena = Arena(100, torch.float32)
    arena.allocate(90)
    with pytest.raises(MemoryError, match=r"allocate 20 x torch\.float32 elements: 96 of 100"):
        arena.allocate(20)
    with pytest.raises(ValueError, match="not a view of this arena"):
        arena.offset_of(torch.zeros(4))
    with pytest.raises(ValueError, match="shared arena lives in CPU memory"):
        Arena(4, shared=True, device="meta")
