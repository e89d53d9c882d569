"""One offloaded unit's optimizer step: the :class:`ZeroOptimizer`'s own inner optimizer,
run on that unit's pieces alone with their values and state pointed into its record.
Any ``torch.optim`` optimizer whose state is per element (Adam, AdamW with amsgrad, SGD
with momentum, Adagrad, RMSprop...) runs so: the record holds the state tensors
:func:`optimizer_state_layout` finds, the scalars (step counts) stay in memory.

The inner optimizer skips every parameter without a ``.grad``, so giving ``.grad`` to
the unit's pieces only steps exactly them, with the group options, step counters and
per-element arithmetic the in-memory ZeRO-3 step uses (the state is elementwise, so a
piece's result does not depend on the other pieces stepped beside it). Between steps
the pieces and their state tensors are empty: only the scalars stay in memory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .param_groups import Piece
from .unit_store import Record
from .units import Unit


def optimizer_state_layout(optimizer: type[torch.optim.Optimizer], options: dict[str, Any]
                           ) -> tuple[tuple[str, ...], dict[str, Any]]:
    """What a unit's record holds beside the master for ``optimizer``: the names of its
    per-element state tensors (Adam's ``exp_avg``, ``exp_avg_sq``; SGD's
    ``momentum_buffer``...), and its scalar state at zero (Adam's ``step``), found by
    stepping a probe parameter once.

    Raises:
        ValueError: an optimizer that cannot step a parameter alone (LBFGS needs a
            closure) or whose state has tensors not shaped like the parameter.
    """
    accepted = inspect.signature(optimizer.__init__).parameters
    options = {k: v for k, v in options.items() if k in accepted}  # defaults hold more
    probe = nn.Parameter(torch.zeros(2))
    try:
        inner = optimizer([probe], **options)
        probe.grad = torch.ones(2)
        inner.step()
    except Exception as exc:  # any failure here: the optimizer cannot run unit by unit
        raise ValueError(f"offload: {optimizer.__name__}({options}) cannot step one "
                         f"parameter alone ({type(exc).__name__}: {exc}); a unit's step "
                         "needs an optimizer whose state is per element") from exc
    state = inner.state[probe]
    tensors = tuple(k for k, v in state.items() if torch.is_tensor(v) and v.shape == probe.shape)
    odd = [k for k, v in state.items()
           if torch.is_tensor(v) and v.dim() > 0 and v.shape != probe.shape]
    if odd:
        raise ValueError(f"offload: {optimizer.__name__} keeps state {odd} not shaped like "
                         "its parameter; a unit's record holds per-element state only")
    scalars = {k: _zero(v) for k, v in state.items() if k not in tensors}
    return tensors, scalars


def _zero(value: Any) -> Any:
    """A scalar state entry before any step (a count at 0; anything else as it is)."""
    if torch.is_tensor(value):
        return torch.zeros_like(value)
    return type(value)(0) if isinstance(value, (int, float)) else value


def unit_stepper(inner: torch.optim.Optimizer, pieces: Sequence[Piece],
                 piece_params: Sequence[nn.Parameter], copy_options: Callable[[], None],
                 fields: tuple[str, ...]) -> Callable[..., Any]:
    """``step(unit, reduced_grad_shard, record)``: step the unit's pieces in place in
    ``record`` (``copy_options`` first brings the groups' current options, as an LR
    scheduler set them, into ``inner``); ``fields``: the state tensors the record holds.

    Raises:
        ValueError: ``inner``'s state is not what the records were laid out for.
    """
    wanted, _ = optimizer_state_layout(type(inner), dict(inner.defaults))
    if wanted != fields:
        raise ValueError(f"offload: the records hold optimizer state {list(fields)}; "
                         f"{type(inner).__name__} keeps {list(wanted)} (build the offload "
                         "for this optimizer)")
    by_unit: dict[int, list[tuple[Piece, nn.Parameter]]] = {}
    for piece, q in zip(pieces, piece_params, strict=True):
        by_unit.setdefault(piece.bucket, []).append((piece, q))
    empty = torch.empty(0, dtype=piece_params[0].dtype if piece_params else torch.float32)

    @torch.no_grad()
    def step(u: Unit, grad: torch.Tensor, record: Record,
             master: torch.Tensor | None = None) -> None:
        """``master``: the shard stepped, when it is not in the record (ZeRO-Offload at
        stages 1-2 keeps it in memory)."""
        copy_options()
        mine = by_unit.get(u.index, [])
        master = record.field("master") if master is None else master
        states = {name: record.field(name) for name in fields}
        kept = [q.data for _, q in mine]  # empty, or (stages 1-2) views of the shards
        for piece, q in mine:
            q.data = master[piece.start : piece.stop]
            q.grad = grad[piece.start : piece.stop]
            state = inner.state.get(q)
            if state:  # after the first step: the state tensors are the record's
                for name in fields:
                    state[name] = states[name][piece.start : piece.stop]
        inner.step()
        for piece, q in mine:
            state = inner.state[q]
            for name in fields:
                home = states[name][piece.start : piece.stop]
                if state[name].data_ptr() != home.data_ptr():  # the first step made them
                    home.copy_(state[name])
                state[name] = empty
        for (_, q), data in zip(mine, kept, strict=True):
            q.grad, q.data = None, data

    return step
