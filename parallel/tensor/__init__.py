"""Megatron-LM tensor parallelism, with sequence parallelism."""

from ..rng import TRACKER, model_parallel_seed
from .apply import apply_tensor_parallel, gather_tensor_parallel_state_dict
from .comms import (
    copy_to_tp_region,
    count_comms,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from .parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .random import TrackedDropout

__all__ = [
    "TRACKER",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TrackedDropout",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tp_region",
    "count_comms",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "gather_tensor_parallel_state_dict",
    "model_parallel_seed",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "vocab_parallel_cross_entropy",
]
