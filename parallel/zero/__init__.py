"""ZeRO-DP: optimizer state, gradients (and, stage 3, parameters) partitioned across ranks."""

from .sharded_checkpoint import consolidate, load_sharded, save_sharded
from .sharded_model import shard_model
from .zero_optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "consolidate", "load_sharded", "save_sharded", "shard_model"]
