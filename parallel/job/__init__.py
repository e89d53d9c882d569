"""A training job's description, shared by the trainer and the layout planner.

- :mod:`.config`: :class:`~.config.TrainConfig` (every flag of ``python -m
  pycomm.parallel.train``, from the command line or a TOML file) and the engine settings it
  implies (:func:`~.config.parallel_config`);
- :mod:`.models`: the model a job names (the project's GPT, a HuggingFace config);
- :mod:`.schedule`: the learning-rate schedule.

The planner (:mod:`pycomm.parallel.planner`) predicts a job before it runs; the trainer
(:mod:`pycomm.parallel.train`) runs it: both read the job from here, neither from the
other.
"""
