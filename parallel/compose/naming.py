"""The name every parameter of this rank has in the unsplit model, whatever the layout:
checkpoints, reports and ties speak of one model.

The pipeline runs :class:`PlannedLayer` modules, so a parameter's path in the stage is
``"<layer>.mods.<k>.<rest>"``; its model path is then ``<the layer's k-th module
path>.<rest>``. A module a style replaced may rename its parameters
(``original_names``: ``nn.MultiheadAttention``'s ``in_proj_weight`` lives in a
column-parallel ``in_proj.weight``). A tied parameter is called by its canonical name.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ParamNames:
    """``id(parameter) -> model name`` for this rank's stage (see the module docstring)."""

    def __init__(self, model: nn.Module, stage: Any, stage_module: nn.Module,
                 canonical: dict[str, str]):
        self.model, self.stage, self.canonical = model, stage, canonical
        self._by_id: dict[int, str] = {}
        self.refresh(stage_module)

    def model_path(self, stage_path: str) -> str:
        """The model path of a path in the stage module (``"0.mods.1.weight"``)."""
        index, _, rest = stage_path.partition(".")
        layer = self.stage.modules[int(index)].layer
        _mods, _, rest = rest.partition(".")
        k, _, rest = rest.partition(".")
        base = layer.paths[int(k)]
        return f"{base}.{rest}" if base and rest else base or rest

    def model_name(self, stage_path: str) -> str:
        """The canonical name in the unsplit model of the parameter at ``stage_path``."""
        path = self.model_path(stage_path)
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix, rest = ".".join(parts[:cut]), ".".join(parts[cut:])
            renamed = getattr(self.model.get_submodule(prefix), "original_names", {})
            if rest in renamed:
                path = f"{prefix}.{renamed[rest]}"
                break
        return self.canonical.get(path, path)

    def refresh(self, stage_module: nn.Module) -> None:
        """Names of the stage's parameters now (after ZeRO-3 replaced them: its own
        record of them, beside the parameters it left whole - the experts)."""
        pairs = list(stage_module.named_parameters())
        zero3 = stage_module.__dict__.get("zero3")
        if zero3 is not None:
            shards = {id(p) for p in stage_module.parameters() if hasattr(p, "zero3")}
            pairs = [(n, p) for n, p in pairs if id(p) not in shards]
            pairs += list(zip(zero3.names, zero3.params, strict=True))
        self._by_id = {id(p): self.model_name(path) for path, p in pairs}

    def of(self, p: nn.Parameter) -> str:
        return self._by_id[id(p)]

    def by_id(self) -> dict[int, str]:
        return dict(self._by_id)

    def materialize_by_stage_name(self, names: list[str]) -> None:
        """Weights for these stage parameters (ZeRO-3 calls it unit by unit)."""
        for stage_path in names:
            owner = self.model_path(stage_path).rpartition(".")[0]
            self.stage.materializer.module(owner, self.model.get_submodule(owner))
