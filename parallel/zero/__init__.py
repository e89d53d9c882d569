"""ZeRO-DP: optimizer state, gradients (and, stage 3, parameters) partitioned across ranks."""

from parallel.zero.zero_optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer"]
