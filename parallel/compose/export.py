"""A checkpoint of any layout as a HuggingFace model folder: ``from_pretrained`` loads it.

The checkpoint keeps the model's own parameter names (the plan names modules by their
paths), so the consolidated state dict is the HuggingFace model's ``state_dict``; the
model is built on the meta device from the config, given those tensors, and written
with ``save_pretrained`` (config and safetensors; a tied head written once, as
transformers writes it). One process, no process group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from parallel._optional import require
from parallel.compose.checkpoint import consolidate


def save_pretrained(checkpoint: str | os.PathLike, config: Any, out: str | os.PathLike
                    ) -> Path:
    """Write the model of ``checkpoint`` (saved by ``engine.save`` in any layout) as a
    HuggingFace folder ``out``.

    Args:
        checkpoint: the checkpoint directory.
        config: the model's HuggingFace config (a ``PretrainedConfig``).
        out: the folder to write.

    Raises:
        ValueError: the checkpoint's names are not this config's model's (strict load).
    """
    transformers = require("transformers", "parallel.compose.save_pretrained (a HuggingFace "
                           "checkpoint)")

    state = consolidate(checkpoint)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    wanted = model.state_dict()
    missing = sorted(set(wanted) - set(state))
    unknown = sorted(set(state) - set(wanted))
    if missing or unknown:
        raise ValueError(f"export: {checkpoint} does not hold this {type(model).__name__}: "
                         f"missing {missing[:5]}, not in the model {unknown[:5]}")
    model.load_state_dict({k: state[k] for k in wanted}, strict=True, assign=True)
    model.tie_weights()
    _rebuild_buffers(model)
    model.save_pretrained(out)
    return Path(out)


def _rebuild_buffers(model: Any) -> None:
    """Non-persistent buffers (a rotary table) are not in a state dict: made again."""
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if list(module.parameters(recurse=False)):
                raise ValueError(f"export: {type(module).__name__} has buffers no checkpoint "
                                 "holds beside its parameters; this model cannot be exported")
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)
