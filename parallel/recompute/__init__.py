"""Activation memory: checkpointing with partitioned or offloaded inputs (ZeRO-R P_a)."""

from .apply import apply_activation_checkpointing, checkpoint_module
from .checkpoint import checkpoint, default_arena
from .fused import fused_bias_dropout_add, fused_bias_gelu
from .fused_blocks import apply_fused_kernels
from .saved_inputs import CheckpointArena

__all__ = ["CheckpointArena", "apply_activation_checkpointing", "apply_fused_kernels",
           "checkpoint", "checkpoint_module", "default_arena", "fused_bias_dropout_add",
           "fused_bias_gelu"]
