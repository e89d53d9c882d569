"""Expert parallelism's dispatch and combine as pycomm ops.

``dispatch`` sends rows to peers with the counts exchanged **inside** the op: each rank
says how many rows it sends each peer (split per group, e.g. per expert of that peer) in
the offer it posts anyway, reads its peers' offers, allocates what it will receive and
moves the rows - one collective, no separate all_to_all of the sizes and no return to
Python between the two (DeepEP's idea, on pycomm's shared-memory transport). It is the
operator ``torch.ops.pycomm.all_to_all_counted`` (csrc/torch/backend/counted.cc); on a
group of another backend (gloo, an islands group) the operator runs as two all_to_alls,
counts then rows, with the same result.

``combine`` is the way back with the counts already known: the rows each rank computed
for its peers return to them in the order they came. Each is the other's backward, so
autograd carries gradients through both::

    rows, counts = pycomm.dispatch(hidden_by_expert, send_counts, group)  # (world, groups)
    out = experts(rows, counts)
    back = pycomm.combine(out, send_counts, counts, group)  # rows in hidden_by_expert's order
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pycomm.ops import group_name, load

_autograd_registered = False


def _register() -> None:
    """The operator's fake kernel (its output's rows are data-dependent) and autograd."""
    global _autograd_registered
    if _autograd_registered:
        return
    load()
    torch.library.register_fake("pycomm::all_to_all_counted")(_counted_fake)
    torch.library.register_autograd("pycomm::all_to_all_counted", _dispatch_backward,
                                    setup_context=_dispatch_setup)
    _autograd_registered = True


def _counted_fake(input: torch.Tensor, send_counts: torch.Tensor, group_name: str) -> Any:
    rows = torch.library.get_ctx().new_dynamic_size()
    return input.new_empty((rows, *input.shape[1:])), torch.empty_like(send_counts)


def _dispatch_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, send_counts, name = inputs
    ctx.sent, ctx.received, ctx.group_name = send_counts, output[1], name


def _dispatch_backward(ctx: Any, grad_rows: torch.Tensor, _grad_counts: Any) -> tuple:
    group = dist.distributed_c10d._resolve_process_group(ctx.group_name)
    return _exchange(grad_rows, ctx.received, ctx.sent, group), None, None


def _exchange(rows: torch.Tensor, have: torch.Tensor, want: torch.Tensor,
              group: Any) -> torch.Tensor:
    """Rows sent per peer as ``have`` counts them (world x groups), received as ``want``."""
    send = have.sum(1).tolist()
    recv = want.sum(1).tolist()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def dispatch(rows: torch.Tensor, send_counts: torch.Tensor,
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (ordered by peer, then group) sent ``send_counts[q, g]`` to peer ``q``'s
    group ``g``; returns the rows received (by source, then group) and their counts
    ``(world, groups)``, int64. Collective over ``group`` (default: the world); the
    backward returns each row's gradient to its sender (a :func:`combine`).

    Raises:
        RuntimeError: counts that are not int64 (world, groups), negative, or do not sum
            to ``rows``' first dimension; ranks disagreeing on the row size or groups.
    """
    _register()
    return torch.ops.pycomm.all_to_all_counted(rows, send_counts, group_name(group))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sent: torch.Tensor, received: torch.Tensor,
                group: Any) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        return _exchange(rows, received, sent, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _exchange(grad, ctx.sent, ctx.received, ctx.group), None, None, None


def combine(rows: torch.Tensor, sent: torch.Tensor, received: torch.Tensor,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The rows a :func:`dispatch` delivered (``received`` counts them), computed, back to
    their senders in the order they were sent (``sent``: the dispatch's send counts).
    Collective; its backward is a dispatch with known counts."""
    return _Combine.apply(rows, sent, received, group if group is not None else dist.group.WORLD)
