"""Mixtures of experts: the load-balancing loss over the whole global batch
(:mod:`pycomm.parallel.moe.balance`)."""
