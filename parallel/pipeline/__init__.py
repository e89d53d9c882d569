"""GPipe pipeline parallelism (and 1F1B) over send/recv between stage ranks."""

from parallel.pipeline.microbatch import split_batch
from parallel.pipeline.pipeline import Event, Pipeline
from parallel.pipeline.schedule import Step, gpipe_schedule, one_f_one_b_schedule

__all__ = ["Event", "Pipeline", "Step", "gpipe_schedule", "one_f_one_b_schedule",
           "split_batch"]
