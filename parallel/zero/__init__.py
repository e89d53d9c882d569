"""ZeRO-DP: optimizer state, gradients (and, stage 3, parameters) partitioned across ranks."""

from parallel.zero.checkpoint import consolidate, load_sharded, save_sharded
from parallel.zero.sharded_model import shard_model
from parallel.zero.zero_optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "consolidate", "load_sharded", "save_sharded", "shard_model"]
