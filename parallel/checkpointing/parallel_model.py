"""Checkpoints of a composed job on ``torch.distributed.checkpoint``: each rank writes
only what it holds, and any layout loads any other.

A parameter (and each of its optimizer state tensors, Adam's moments) is saved as the
whole tensor of the unsplit model, under its model name: every rank contributes its
pieces — its tensor-parallel part, or under ZeRO its flat range of that part — as
chunks in the whole tensor's coordinates (:mod:`pycomm.parallel.checkpointing.dcp_chunks`);
data-parallel replicas hold the same chunks, which DCP writes once. No rank gathers a
parameter. Loading in another layout asks for the chunks this layout holds, and DCP
reads what overlaps them: pipeline stages, TP size, DP size and ZeRO stage may all
differ. :func:`consolidate` gives the plain model's ``state_dict`` without any process
group. A directory that exists is complete (DCP writes into ``<dir>.partial``, renamed
once every rank has written).

Beside the tensors: the step count of the learning-rate schedule (on load, the
schedule of the *loading* run continues from that step: a changed number of steps or
peak learning rate takes effect), fp16's loss scale, and the caller's ``extra``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..tensor.sharding import spec_of
from . import dcp_chunks
from .chunks import whole_shape
from .dcp_chunks import Chunk, ChunkedTensor, chunks_of

FORMAT = "pycomm-dcp/1"


def _shifted(chunk: Chunk, first: int) -> Chunk:
    """A chunk of a parameter holding rows ``first`` on of the whole tensor, placed in
    it (``row_slice``: expert parallelism's experts, ZeRO-3's tiles)."""
    if not first:
        return chunk
    return Chunk((chunk.offsets[0] + first, *chunk.offsets[1:]), chunk.data)


def tensor_state(engine: Any, owned_only: bool = False
                 ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """This rank's chunks of every parameter and optimizer state tensor, and the keys of
    each parameter's scalar state (Adam's step) by name. ``owned_only``: without the
    copies of a parameter tied across pipeline stages that a stage other than its
    owner's holds (each stage's ZeRO cuts its copy into other ranges; the copies are
    equal, and a save writes the owner's)."""
    tp, tp_rank = engine.mesh.size("tp"), engine.mesh.rank("tp")
    stage, stage_of = engine.mesh.rank("pp"), engine.stage_plan.stage_of
    state: dict[str, Any] = {}
    scalars: dict[str, list[str]] = {}
    for p, local, start, values, tensors, scalar in engine.dp.pieces():
        name = engine.names.of(p)
        if owned_only and stage_of.get(name, stage) != stage:
            continue
        whole = whole_shape(local, p, tp)
        first, rows = getattr(p, "row_slice", (0, whole[0] if whole else 0))
        for key, flat in [("model", values), *((f"optim.{k}", t) for k, t in tensors.items())]:
            target = state.setdefault(f"{key}/{name}", ChunkedTensor(
                torch.Size([rows, *whole[1:]]) if whole else whole, flat.dtype, []))
            target.chunks += [_shifted(c, first)
                              for c in chunks_of(whole, spec_of(p), tp, tp_rank, flat, start)]
        for key, value in scalar.items():
            state[f"optim_scalar.{key}/{name}"] = value
        scalars[name] = sorted(scalar)
    return state, scalars


def _objects(engine: Any, extra: dict[str, Any]) -> dict[str, Any]:
    scaler = engine.scaler.state_dict() if engine.scaler is not None else None
    return {"meta/format": FORMAT, "meta/extra": extra,
            "meta/schedule_step": int(engine.scheduler.last_epoch),
            "meta/loss_scale": scaler, "meta/aliases": engine.stage_plan.canonical,
            "meta/layout": [engine.mesh.size(d) for d in ("pp", "dp", "tp")]}


def _scalar_value(value: Any) -> Any:
    return float(value) if torch.is_tensor(value) else value


def save(engine: Any, directory: str | os.PathLike, extra: dict[str, Any]) -> None:
    """Write ``engine``'s parameters, optimizer state, schedule position and ``extra``
    (step, data position...) to ``directory``. Collective over the world."""
    state, _ = tensor_state(engine, owned_only=True)
    state = {k: v if isinstance(v, ChunkedTensor) else _scalar_value(v) for k, v in state.items()}
    state.update(_objects(engine, extra))
    try:
        dcp_chunks.save(state, directory, release=engine.dp.release_view())
    finally:
        del state
        engine.dp.saved()


def load(engine: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint of any layout into ``engine``; returns the ``extra`` it was
    saved with. Collective over the world.

    Raises:
        ValueError: on every rank, naming what is missing or differs (another model, an
            optimizer with other state), before anything is written.
    """
    state, scalars = tensor_state(engine)
    wanted = {k: v if isinstance(v, ChunkedTensor) else None for k, v in state.items()}
    wanted.update(dict.fromkeys(_objects(engine, {})))
    try:
        got = dcp_chunks.load(wanted, directory, release=engine.dp.release_view())
    except BaseException:
        del state, wanted
        engine.dp.saved()  # offloaded: nothing was written, the store's views are let go
        raise
    del state, wanted  # offloaded: views of the store, released before it is flushed
    if got["meta/format"] != FORMAT:
        raise ValueError(f"checkpoint {directory}: format {got['meta/format']!r}, "
                         f"expected {FORMAT!r}")
    for p in engine.params:
        name = engine.names.of(p)
        values = {k: got[f"optim_scalar.{k}/{name}"] for k in scalars.get(name, [])}
        engine.dp.set_scalars(p, {k: _as_state(v) for k, v in values.items()})
    engine.dp.loaded()
    _continue_schedule(engine, int(got["meta/schedule_step"]))
    if engine.scaler is not None and got["meta/loss_scale"] is not None:
        engine.scaler.load_state_dict(got["meta/loss_scale"])
    return dict(got["meta/extra"])


def _as_state(value: Any) -> Any:
    """A scalar as torch's optimizers keep it (Adam's ``step`` is a 0-d tensor)."""
    return torch.tensor(value) if isinstance(value, float) else value


def _continue_schedule(engine: Any, step: int) -> None:
    """The loading run's own schedule (its peak learning rate, its number of steps),
    continued from ``step``: what the saved run's schedule said is not reused."""
    scheduler = engine.scheduler
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                  strict=True)]
    for group, lr in zip(engine.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


def consolidate(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` (its own names, every alias of a tied parameter
    included) from a checkpoint of any layout, in one process."""
    keys = dcp_chunks.saved_keys(directory)
    model_keys = [k for k in keys if k.startswith("model/")]
    whole = dcp_chunks.read_whole(directory, [*model_keys, "meta/aliases"])
    out = {k.removeprefix("model/"): v for k, v in whole.items() if k.startswith("model/")}
    for alias, canonical in whole["meta/aliases"].items():
        out.setdefault(alias, out[canonical])
    return out
