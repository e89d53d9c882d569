"""The conjugate communication pairs of Megatron-LM tensor (and sequence) parallelism.

Each function is an autograd operation whose backward is the conjugate of its forward,
so a parallel layer is its local math between two of them. ``f`` and ``g`` in the
paper are :func:`copy_to_tp_region` and :func:`reduce_from_tp_region`. Sequence
parallelism replaces the all-reduce of ``g`` by a reduce-scatter along the sequence and
the identity of ``f`` by an all-gather, so activations between layers (norms, dropout,
residuals) are split along the sequence too.

Every collective goes through :func:`_record`, so :class:`count_comms` can assert how
many of each a layer issues.

The sequence dimension is 1 (activations are ``(batch, time, hidden)``), the hidden
dimension the last.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from pycomm import ops as pycomm_ops

Group = dist.ProcessGroup | None
SEQ_DIM = 1
_counters: list[Counter[str]] = []
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@contextmanager
def count_comms() -> Iterator[Counter[str]]:
    """Counts the collectives issued inside, as ``"all_reduce:forward"`` and so on."""
    counter: Counter[str] = Counter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward
    return task is not None and task() != -1


def _record(op: str) -> None:
    if _counters:
        phase = "backward" if _in_backward() else "forward"
        for counter in _counters:
            counter[f"{op}:{phase}"] += 1


# -- the primitives, each one collective (or none) -----------------------------------------------


_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
             dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod"}


def all_reduce(x: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """In place on a contiguous ``x`` (which is returned).

    CPU tensors take ``pycomm.all_reduce_``: on a pycomm group one native call in eager
    mode, the ``torch.ops.pycomm.all_reduce_`` operator while torch.compile traces;
    never torch.distributed's wrapper and Work (the layer's forward waits for it anyway).
    It serves any backend, pycomm's on its fast path.
    """
    _record("all_reduce")
    x = x.contiguous()
    if x.device.type == "cpu" and op in _OP_NAMES and _pycomm_ops():
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None, "all_reduce needs a process group"
        pycomm_ops.all_reduce_(x, _OP_NAMES[op], pg)
    else:
        dist.all_reduce(x, op=op, group=group)
    return x


def _pycomm_ops() -> bool:
    """Whether torch.ops.pycomm.all_reduce_ exists: pycomm's extension, which defines it,
    is loaded (a pycomm group was created here). Asked of sys.modules, which is cheap;
    asking torch.ops for a missing operator costs microseconds every time."""
    return "pycomm._C" in sys.modules


def all_reduce_async(x: torch.Tensor, group: Group) -> Any:
    """Start summing the contiguous ``x`` in place; returns the Work to wait on."""
    _record("all_reduce")
    return dist.all_reduce(x, group=group, async_op=True)


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's 1/TP of the last dimension (no communication)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=-1)[rank].contiguous()


def gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension."""
    return gather_dim(x, x.dim() - 1, group)


def split_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallel: dimension {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=dim)[rank].contiguous()


def gather_dim(x: torch.Tensor, dim: int, group: Group, async_op: bool = False) -> Any:
    """All-gather stacks along dim 0; moving ``dim`` there and back keeps it one call.
    With ``async_op`` returns (work, finish) where ``finish()`` gives the tensor."""
    _record("all_gather")
    world = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather(out, local, group=group, async_op=async_op)
    finish = lambda: out.movedim(0, dim)  # noqa: E731
    return (work, finish) if async_op else finish()


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: Group, async_op: bool = False) -> Any:
    """Sum over ranks, each keeping its 1/TP of ``dim``. With ``async_op``: (work, finish)."""
    _record("reduce_scatter")
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallel: dimension {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {world}")
    full = x.movedim(dim, 0).contiguous()
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter(out, full, group=group, async_op=async_op)
    finish = lambda: out.movedim(0, dim)  # noqa: E731
    return (work, finish) if async_op else finish()


# -- the conjugate pairs ---------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return split_last(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return split_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return gather_dim(grad, SEQ_DIM, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.grad_is_partial:  # what follows was tensor-parallel: sum the partial grads
            return reduce_scatter_dim(grad, SEQ_DIM, ctx.group), None, None
        return split_dim(grad, SEQ_DIM, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return gather_dim(grad, SEQ_DIM, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f``. Forward: identity (every rank has the whole input). Backward: all-reduce
    (each rank's gradient covers only its columns' contribution)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g``. Forward: all-reduce (sum the partial outputs of a row-parallel layer).
    Backward: identity (the sum's gradient is the same for every term)."""
    return _ReduceFromRegion.apply(x, group)


def sum_over_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: all-reduce (a statistic of every rank's rows, as a synchronised
    BatchNorm's). Backward: all-reduce (every rank's use of the sum depends on each
    rank's ``x``)."""
    return _SumOverGroup.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: keep this rank's 1/TP of the last dimension. Backward: all-gather it."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: all-gather along the last dimension. Backward: keep this rank's part."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: keep this rank's 1/TP of the sequence. Backward: all-gather the sequence."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: Group,
                                grad_is_partial: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence. Backward: reduce-scatter it (the layer after is
    tensor-parallel, so each rank's gradient is a partial sum), or with
    ``grad_is_partial=False`` just keep this rank's part."""
    return _GatherFromSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: reduce-scatter along the sequence (sum the row-parallel partial outputs,
    each rank keeping its 1/TP of the tokens). Backward: all-gather the sequence."""
    return _ReduceScatterToSequence.apply(x, group)


_SEQUENCE_PART = "_pycomm_sequence_part"


def gather_sequence_into_region(x: torch.Tensor, group: Group, keep_part: bool = True
                                ) -> torch.Tensor:
    """:func:`gather_from_sequence_region` where a split region begins. With ``keep_part``
    the result remembers ``x``: a column-parallel layer of the region that takes it as
    is keeps ``x`` for its weight's gradient, not the gathered sequence (it gathers it
    again in backward: :func:`sequence_part`)."""
    whole = gather_from_sequence_region(x, group)
    if keep_part:
        setattr(whole, _SEQUENCE_PART, x)
    return whole


def sequence_part(x: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``x``, if ``x`` is a region's gathered sequence that
    remembers it (:func:`gather_sequence_into_region`)."""
    return getattr(x, _SEQUENCE_PART, None)
