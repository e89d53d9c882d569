"""Checkpoints of a composed job, keyed by mesh position, loadable in any other layout.

A checkpoint is a directory: ``meta.json`` (the layout, the step's extra data, where
each parameter lives) and one file per (pipeline stage, tensor-parallel rank),
``pp{p}-tp{t}.pt``, holding that rank's tensor-parallel part of each of its stage's
parameters and of their optimizer state (Adam's moments), whole over data parallelism
(ZeRO shards are gathered first; data-parallel replicas are equal, so one of them
writes), with each parameter's :class:`TPSpec`. Loading in another layout rebuilds each
whole tensor from the saved parts and splits it as this layout needs: pipeline stages,
TP size, DP size and ZeRO stage may all differ. :func:`consolidate` gives the plain
model's ``state_dict`` without any process group.

Writes go to ``<dir>.partial`` and are renamed once every rank has written, so a
directory that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel.tensor.sharding import TPSpec, spec_of

FORMAT = "pycomm-mesh-checkpoint/1"


def _file(pp: int, tp: int) -> str:
    return f"pp{pp}-tp{tp}.pt"


def save(engine: Any, directory: str | os.PathLike, extra: dict[str, Any]) -> None:
    """Write ``engine``'s parameters and optimizer state, and ``extra`` (step, data
    position...) to ``directory``. Collective over the world."""
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    local = engine.dp.local_state(engine.names)  # collective over dp (ZeRO gathers)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    pp, dp, tp = engine.mesh.coordinates
    if dp == 0:
        torch.save(local, partial / _file(pp, tp))
    names = _gather_names(engine, pp, tp)
    if dist.get_rank() == 0:
        meta = {"format": FORMAT, "mesh": asdict(engine.mesh.shape), "extra": extra,
                "files": names, "scheduler": engine.scheduler.state_dict(),
                "model": asdict(engine.cfg)}
        (partial / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    dist.barrier()


def _gather_names(engine: Any, pp: int, tp: int) -> dict[str, str]:
    """parameter name -> the file holding it (one writer's view is enough per file)."""
    mine = {name: _file(pp, tp) for name in engine.names.values()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, str] = {}
    for names in everyone:
        out.update(names)
    return out


class SavedModel:
    """A checkpoint directory, read lazily: whole tensors by parameter name."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"checkpoint {self.dir}: no meta.json (not a complete "
                                    f"checkpoint; an interrupted save leaves only "
                                    f"{self.dir.name}.partial)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint {self.dir}: format {self.meta.get('format')!r}, "
                             f"expected {FORMAT!r}")
        self.tp = int(self.meta["mesh"]["tp"])
        self._files: dict[str, dict[str, Any]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.meta["files"])

    def _load(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            self._files[name] = torch.load(self.dir / name, weights_only=False)
        return self._files[name]

    def _parts(self, name: str) -> list[dict[str, Any]]:
        if name not in self.meta["files"]:
            raise KeyError(f"checkpoint {self.dir}: no parameter {name!r}")
        pp = self.meta["files"][name].split("-")[0]
        return [self._load(f"{pp}-tp{t}.pt")[name] for t in range(self.tp)]

    def whole(self, name: str) -> dict[str, Any]:
        """``{"param": tensor, "state": {key: tensor}}`` of ``name``, unsplit."""
        parts = self._parts(name)
        spec = TPSpec(*parts[0]["spec"])
        state = {}
        for key, value in parts[0]["state"].items():
            if torch.is_tensor(value) and value.shape == parts[0]["param"].shape:
                state[key] = spec.unshard([p["state"][key] for p in parts])
            else:  # a scalar (Adam's step count): the same on every part
                state[key] = value
        return {"param": spec.unshard([p["param"] for p in parts]), "state": state}


def load(engine: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint of any layout into ``engine``; returns the ``extra`` it was
    saved with. Collective over the world."""
    saved = SavedModel(directory)
    world_tp, rank_tp = engine.mesh.size("tp"), engine.mesh.rank("tp")
    wanted = {}
    for p in engine.parameters():
        name = engine.names[id(p)]
        whole = saved.whole(name)
        spec = spec_of(p)
        param = spec.shard(whole["param"], world_tp, rank_tp)
        state: dict[str, Any] = {}
        for key, value in whole["state"].items():
            is_full = torch.is_tensor(value) and value.shape == whole["param"].shape
            state[key] = spec.shard(value, world_tp, rank_tp) if is_full else value
        if param.shape != engine.shapes[id(p)]:
            raise ValueError(f"checkpoint {saved.dir}: {name} has shape "
                             f"{tuple(whole['param'].shape)}, which this layout splits into "
                             f"{tuple(param.shape)}, not this model's "
                             f"{tuple(engine.shapes[id(p)])}")
        wanted[id(p)] = {"param": param, "state": state}
    engine.dp.load_local_state(wanted)  # collective over dp (ZeRO shards)
    engine.scheduler.load_state_dict(saved.meta["scheduler"])
    # The scheduler's state holds the learning rate it last set; the groups get it back.
    for group, lr in zip(engine.optimizer.param_groups, engine.scheduler.get_last_lr(),
                         strict=True):
        group["lr"] = lr
    dist.barrier()
    return dict(saved.meta["extra"])


def consolidate(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` (the reference GPT's names), from a checkpoint
    of any layout, in one process."""
    saved = SavedModel(directory)
    return {name: saved.whole(name)["param"] for name in saved.names}
