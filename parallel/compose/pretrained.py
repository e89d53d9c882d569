"""Pretrained weights from HuggingFace safetensors into the sharded engine: each rank reads
only the pieces it holds (its tensor-parallel part, its ZeRO range of it, its pipeline
stage's layers), as torchtitan and DCP do, never the whole model.

The pieces are those a checkpoint saves
(:func:`pycomm.parallel.checkpointing.parallel_model.tensor_state`: chunks in the whole
tensor's coordinates, views of this rank's fp32 masters), read with
``safe_open(...).get_slice(name)[box]`` from the memory-mapped files, then published to the
model as after a checkpoint's load. The optimizer state starts fresh. A model built on the
meta device (``--init meta``) so never holds the whole model on any rank.

Example::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    engine = parallelize(model, mesh, ParallelConfig(zero=3))
    engine.load_pretrained(path)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._optional import require
from ..checkpointing.parallel_model import tensor_state

INDEX = "model.safetensors.index.json"


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """Each tensor name of a ``save_pretrained`` folder -> the file holding it.

    Raises:
        FileNotFoundError: no safetensors file in ``directory``.
    """
    folder = Path(directory)
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"load_pretrained: no *.safetensors (nor {INDEX}) in {folder}")
    safetensors = require("safetensors", "load_pretrained (HuggingFace weights)")
    out = {}
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _stored_name(name: str, aliases: dict[str, str], stored: dict[str, Path]) -> str:
    """The name under which the files hold parameter ``name`` (a tied parameter may be
    stored under any of its names: HuggingFace keeps one)."""
    candidates = [name, *(a for a, c in aliases.items() if c == name)]
    for candidate in candidates:
        if candidate in stored:
            return candidate
    raise KeyError(f"load_pretrained: the files hold no {' or '.join(candidates)}")


def load_pretrained(engine: Any, directory: str | Path) -> int:
    """Fill this rank's parameters from the safetensors in ``directory``; returns the
    elements read. Collective only in publishing the values (ZeRO's shards).

    Raises:
        KeyError: a parameter the files do not hold.
        ValueError: a tensor whose shape differs from the model's.
    """
    safetensors = require("safetensors", "load_pretrained (HuggingFace weights)")
    stored = tensor_files(directory)
    state, _ = tensor_state(engine)
    aliases = engine.stage_plan.canonical
    handles: dict[Path, Any] = {}
    read = 0
    try:
        for key, chunked in state.items():
            if not key.startswith("model/"):
                continue
            name = _stored_name(key.removeprefix("model/"), aliases, stored)
            file = stored[name]
            if file not in handles:
                handles[file] = safetensors.safe_open(str(file), framework="pt")
            piece = handles[file].get_slice(name)
            if tuple(piece.get_shape()) != tuple(chunked.shape):
                raise ValueError(f"load_pretrained: {name} has shape {tuple(piece.get_shape())} "
                                 f"in {file.name}, the model's is {tuple(chunked.shape)}")
            for chunk in chunked.chunks:
                box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.data.shape,
                                                             strict=True))
                chunk.data.copy_(piece[box])
                read += chunk.data.numel()
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    engine.dp.loaded()
    return read
