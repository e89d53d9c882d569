"""A model's plan: what each part of the model becomes under parallelism.

- :mod:`.plan`: the :class:`~.plan.Plan` type (module path patterns -> tensor-parallel
  styles, the layers a pipeline cuts between, the inputs a model takes);
- :mod:`.styles`: the tensor-parallel styles a plan names (column-wise, row-wise, ...).

The plans of the project's models and of HuggingFace families are in
:mod:`pycomm.parallel.models`; :func:`pycomm.parallel.compose.parallelize` applies one.
(The layout planner, which picks dp, tp, pp and ZeRO for a job, is
:mod:`pycomm.parallel.planner`.)
"""
