"""A checkpoint of any layout as a HuggingFace model folder: ``from_pretrained`` loads it.

The checkpoint keeps the model's own parameter names (the plan names modules by their
paths), so its tensors are the HuggingFace model's ``state_dict``: the names are
checked against the model built on the meta device from the config, and each tensor is
streamed into safetensors files (a tied head written once, as transformers writes it).
One process, no process group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._optional import require
from ..checkpointing import dcp_chunks

SHARD_BYTES = 2 << 30  # safetensors files of at most this much (HF's default is 5 GB)


def save_pretrained(checkpoint: str | os.PathLike, config: Any, out: str | os.PathLike,
                    shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the model of ``checkpoint`` (saved by ``engine.save`` in any layout) as a
    HuggingFace folder ``out``, streaming: each tensor is read whole from the
    checkpoint and written into safetensors files of at most ``shard_bytes`` (with
    HF's ``model.safetensors.index.json`` when there are several), so no more than one
    file's tensors are in memory, whatever the model's size.

    Args:
        checkpoint: the checkpoint directory.
        config: the model's HuggingFace config (a ``PretrainedConfig``).
        out: the folder to write.
        shard_bytes: the most tensor bytes in one safetensors file.

    Raises:
        ValueError: the checkpoint's names are not this config's model's (strict).
    """
    transformers = require("transformers", "pycomm.parallel.compose.save_pretrained (a HuggingFace "
                           "checkpoint)")
    save_file = require("safetensors.torch", "the HuggingFace export").save_file

    saved = {k.removeprefix("model/"): v for k, v in dcp_chunks.saved_keys(checkpoint).items()
             if k.startswith("model/")}
    aliases = dcp_chunks.read_whole(checkpoint, ["meta/aliases"])["meta/aliases"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    wanted = set(model.state_dict())
    held = set(saved) | set(aliases)
    missing, unknown = sorted(wanted - held), sorted(held - wanted)
    if missing or unknown:
        raise ValueError(f"export: {checkpoint} does not hold this {type(model).__name__}: "
                         f"missing {missing[:5]}, not in the model {unknown[:5]}")
    shards = _shards({name: saved[name] for name in sorted(saved)}, shard_bytes)
    Path(out).mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = dcp_chunks.read_whole(checkpoint, [f"model/{n}" for n in names])
        save_file({n: tensors[f"model/{n}"] for n in names}, os.path.join(out, file),
                  metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return Path(out)


def _shards(sizes: dict[str, Any], limit: int) -> list[list[str]]:
    """Names in files of at most ``limit`` bytes (a larger tensor alone in its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype) in sizes.items():
        nbytes = shape.numel() * dtype.itemsize
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards
