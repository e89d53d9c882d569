"""Checkpointing one block, or chosen blocks of an unchanged model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..blocks import default_unit_modules
from .checkpoint import checkpoint
from .partition import refuse_sequence_parallel
from .saved_inputs import CheckpointArena

Policy = str | int | type | tuple[type, ...] | Callable[[str, nn.Module], bool]


def _chosen(model: nn.Module, policy: Policy) -> list[nn.Module]:
    if isinstance(policy, str):
        if policy != "every":
            raise ValueError(f"apply_activation_checkpointing: unknown policy {policy!r}; "
                             "use 'every', an int k, module types, or a callable")
        return default_unit_modules(model)
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"apply_activation_checkpointing: every k-th block needs k >= 1, "
                             f"got {policy}")
        return default_unit_modules(model)[::policy]
    if isinstance(policy, type) or (isinstance(policy, tuple)
                                    and all(isinstance(t, type) for t in policy)):
        return [m for m in model.modules() if isinstance(m, policy) and m is not model]
    if callable(policy):
        return [m for name, m in model.named_modules() if m is not model and policy(name, m)]
    raise TypeError(f"apply_activation_checkpointing: cannot use {policy!r} as a policy")


def checkpoint_module(module: nn.Module, partition_group: Any = None, offload: bool = False,
                      arena: CheckpointArena | None = None) -> nn.Module:
    """Checkpoint one module (a block) in place: its ``forward`` runs through
    :func:`checkpoint`, so its activations are recomputed in backward with every random
    stream replayed. Returns ``module``.

    Raises:
        ValueError: with ``partition_group``, if ``module`` has a sequence-parallel layer.
    """
    if partition_group is not None:
        refuse_sequence_parallel(module, "checkpoint_module")
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"a checkpointed {type(module).__name__} takes positional "
                            f"arguments only, got {sorted(kwargs)}")
        return checkpoint(forward, *args, partition_group=partition_group, offload=offload,
                          arena=arena)

    module.forward = checkpointed
    return module


def apply_activation_checkpointing(model: nn.Module, policy: Policy = "every",
                                   partition_group: Any = None, offload: bool = False,
                                   arena: CheckpointArena | None = None) -> list[nn.Module]:
    """Checkpoint the modules ``policy`` picks with :func:`checkpoint_module` (the
    model's code is unchanged). ``policy``: ``"every"`` block (each child of an
    ``nn.ModuleList``), an int ``k`` (every k-th block), module types, or
    ``fn(name, module) -> bool``. Returns the wrapped modules.

    Raises:
        ValueError: an unknown policy, or ``partition_group`` (P_a) on a model with a
            sequence-parallel layer (its blocks' inputs differ across the TP ranks).
    """
    if partition_group is not None:
        refuse_sequence_parallel(model, "apply_activation_checkpointing")
    chosen = _chosen(model, policy)
    for module in chosen:
        checkpoint_module(module, partition_group, offload, arena)
    return chosen
