"""Activation memory: checkpointing with partitioned or offloaded inputs (ZeRO-R P_a)."""

from parallel.recompute.apply import apply_activation_checkpointing
from parallel.recompute.arena import CheckpointArena
from parallel.recompute.checkpoint import checkpoint, default_arena

__all__ = ["CheckpointArena", "apply_activation_checkpointing", "checkpoint", "default_arena"]
