"""Models the strategies are tested on: the project's own GPT, and the plans that tell
:func:`pycomm.parallel.compose.parallelize` how to split a model it did not write."""

from .gpt import GPT, Block, GPTConfig, lm_loss, synthetic_batch

__all__ = ["GPT", "Block", "GPTConfig", "lm_loss", "synthetic_batch"]
