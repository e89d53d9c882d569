"""GPipe pipeline parallelism (and 1F1B) over send/recv between stage ranks."""

from .balance import balance_by_size, balance_by_time, partition
from .memory import ActivationMeter
from .microbatch import split_batch
from .pipeline import Event, Pipeline
from .schedule import Step, gpipe_schedule, one_f_one_b_schedule
from .timeline import idle_fractions, plot_timeline

__all__ = ["ActivationMeter", "Event", "Pipeline", "Step", "balance_by_size", "balance_by_time",
           "gpipe_schedule", "idle_fractions", "one_f_one_b_schedule", "partition",
           "plot_timeline", "split_batch"]
