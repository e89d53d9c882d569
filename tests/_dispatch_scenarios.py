"""Rank bodies for tests/test_dispatch.py: pycomm's dispatch (the all_to_all that learns
its counts inside the op) and combine, against ``all_to_all_single`` on a gloo group."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import pycomm

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int64)
GROUPS = (1, 3, 8)
ROW_SHAPES = ((5,), (2, 3))


def _reference(rows: torch.Tensor, counts: torch.Tensor, gloo: dist.ProcessGroup
               ) -> tuple[torch.Tensor, torch.Tensor]:
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=gloo)
    out = rows.new_empty((int(recv.sum()), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, output_split_sizes=recv.sum(1).tolist(),
                           input_split_sizes=counts.sum(1).tolist(), group=gloo)
    return out, recv


def _case(seed: int, dtype: torch.dtype, groups: int, row: tuple[int, ...]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows and counts: uneven, with zeros, and one rank sending nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    counts = torch.randint(0, 4, (world, groups), generator=gen)
    if rank == seed % world:
        counts.zero_()
    rows = (torch.randn(int(counts.sum()), *row, generator=gen, dtype=torch.float64) * 100)
    return rows.to(dtype), counts


def matches_all_to_all(backend: str) -> list[str]:
    """Every dtype x groups x row shape: the rows and counts received equal gloo's
    all_to_all_single of the same rows; combine brings every row back."""
    gloo = dist.new_group(backend="gloo")
    group = dist.new_group(backend=backend)
    problems = []
    cases = itertools.product(DTYPES, GROUPS, ROW_SHAPES)
    for seed, (dtype, groups, row) in enumerate(cases):
        rows, counts = _case(seed, dtype, groups, row)
        got, recv = pycomm.dispatch(rows, counts, group)
        want, want_recv = _reference(rows, counts, gloo)
        back = pycomm.combine(got, counts, recv, group)
        if not (torch.equal(recv, want_recv) and torch.equal(got, want)
                and torch.equal(back, rows)):
            problems.append(f"rank {dist.get_rank()}: {dtype} groups {groups} row {row}")
    return problems


def gradients_return_to_their_rows() -> bool:
    """dispatch -> x * w -> combine -> loss: each row's gradient, through both ops'
    backward, is what one process computes (float64, exact)."""
    world = dist.get_world_size()
    rows, counts = _case(7, torch.float64, 4, (6,))
    rows.requires_grad_(True)
    got, recv = pycomm.dispatch(rows, counts)
    weight = torch.arange(1.0, 7.0, dtype=torch.float64)
    back = pycomm.combine(got * weight, counts, recv)
    probe = torch.linspace(-1, 1, back.numel(), dtype=torch.float64).view_as(back)
    (back * probe).sum().backward()
    return bool(torch.equal(back.detach(), rows.detach() * weight)
                and torch.equal(rows.grad, probe * weight)) and world > 1


def bad_input_errors() -> list[str]:
    """Each bad call raises naming what was wrong; the group still works after."""
    world = dist.get_world_size()
    rows = torch.ones(4, 2)
    calls = (
        lambda: pycomm.dispatch(rows, torch.ones(world, dtype=torch.int64)),  # 1-D
        lambda: pycomm.dispatch(rows, torch.ones(world, 2, dtype=torch.int32)),  # int32
        lambda: pycomm.dispatch(rows, torch.full((world, 1), 3, dtype=torch.int64)),  # sum
        lambda: pycomm.dispatch(rows, torch.tensor([[-1]] + [[5]] + [[0]] * (world - 2))),
        lambda: pycomm.dispatch(torch.ones(0, 2), torch.zeros(world, 100_000,
                                                              dtype=torch.int64)),
    )
    msgs = []
    for call in calls[:-1]:
        try:
            call()
            msgs.append("no error")
        except Exception as e:  # the message is what is checked
            msgs.append(f"{type(e).__name__}: {e}".splitlines()[0])
    # more counts than the op's offer holds: the counts go first, the same result
    got, recv = calls[-1]()
    msgs.append(f"{tuple(got.shape)} {tuple(recv.shape)} {int(recv.sum())}")
    counts = torch.zeros(world, 1, dtype=torch.int64)
    counts[:, 0] = 1
    got, recv = pycomm.dispatch(torch.full((world, 2), float(dist.get_rank())), counts)
    msgs.append(str(got[:, 0].tolist()))
    return msgs
