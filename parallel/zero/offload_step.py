"""One offloaded unit's optimizer step: the :class:`ZeroOptimizer`'s own inner optimizer,
run on that unit's pieces alone with their values and state pointed into its record.

The inner optimizer skips every parameter without a ``.grad``, so giving ``.grad`` to
the unit's pieces only steps exactly them, with the group options, step counters and
per-element arithmetic the in-memory ZeRO-3 step uses (Adam and AdamW keep
``exp_avg`` and ``exp_avg_sq``, elementwise, so a piece's result does not depend on the
other pieces stepped beside it). Between steps the pieces and their state tensors are
empty: only the step counters (scalars) stay in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from parallel.zero.offload import STATE_FIELDS
from parallel.zero.param_groups import Piece
from parallel.zero.unit_store import Record
from parallel.zero.units import Unit

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def check_optimizer(inner: torch.optim.Optimizer) -> None:
    """Raises ValueError for an optimizer whose state is not Adam's two moments."""
    if type(inner) not in SUPPORTED:
        raise ValueError(f"offload: the optimizer must be torch.optim.Adam or AdamW (its "
                         f"state is what a unit's record holds), got {type(inner).__name__}")
    if any(group.get("amsgrad") for group in inner.param_groups):
        raise ValueError("offload: amsgrad keeps a third state tensor; not supported")


def unit_stepper(inner: torch.optim.Optimizer, pieces: Sequence[Piece],
                 piece_params: Sequence[nn.Parameter],
                 copy_options: Callable[[], None]) -> Callable[[Unit, torch.Tensor, Record], Any]:
    """``step(unit, reduced_grad_shard, record)``: step the unit's pieces in place in
    ``record`` (``copy_options`` first brings the groups' current options, as an LR
    scheduler set them, into ``inner``)."""
    check_optimizer(inner)
    by_unit: dict[int, list[tuple[Piece, nn.Parameter]]] = {}
    for piece, q in zip(pieces, piece_params, strict=True):
        by_unit.setdefault(piece.bucket, []).append((piece, q))
    empty = torch.empty(0, dtype=piece_params[0].dtype if piece_params else torch.float32)

    @torch.no_grad()
    def step(u: Unit, grad: torch.Tensor, record: Record) -> None:
        copy_options()
        mine = by_unit.get(u.index, [])
        master = record.field("master")
        states = {name: record.field(name) for name in STATE_FIELDS}
        for piece, q in mine:
            q.data = master[piece.start : piece.stop]
            q.grad = grad[piece.start : piece.stop]
            state = inner.state.get(q)
            if state:  # after the first step: the moments are the record's
                for name in STATE_FIELDS:
                    state[name] = states[name][piece.start : piece.stop]
        inner.step()
        for piece, q in mine:
            state = inner.state[q]
            for name in STATE_FIELDS:
                home = states[name][piece.start : piece.stop]
                if state[name].data_ptr() != home.data_ptr():  # the first step made them
                    home.copy_(state[name])
                state[name] = empty
            q.grad, q.data = None, empty

    return step
