"""A model's plan: what each part of the model becomes under parallelism.

- :mod:`.plan`: the :class:`~.plan.Plan` type (module path patterns -> tensor-parallel
  styles, the layers a pipeline cuts between, the inputs a model takes).

It stands on the ground floor: a plan names what each strategy does to a module, and
each strategy's package applies it (the tensor-parallel styles, column-wise, row-wise
and the others, and their application are :mod:`pycomm.parallel.tensor.styles` and
:mod:`pycomm.parallel.tensor.from_plan`).

The plans of the project's models and of HuggingFace families are in
:mod:`pycomm.parallel.models`; :func:`pycomm.parallel.compose.parallelize` applies one.
(The layout planner, which picks dp, tp, pp and ZeRO for a job, is
:mod:`pycomm.parallel.planner`.)
"""
