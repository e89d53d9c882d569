"""The layout planner: every (dp, tp, pp, ZeRO, recompute, P_a, offload) layout the
trainer accepts, with predicted per-rank memory and step time (``python -m pycomm.parallel.plan``).

- :mod:`~pycomm.parallel.plan.shapes`: the model's parameters per layer, as its plan splits them;
- :mod:`~pycomm.parallel.plan.layouts`: the layouts, filtered by the project's own checks;
- :mod:`~pycomm.parallel.plan.memory`, :mod:`~pycomm.parallel.plan.activations`: bytes per rank;
- :mod:`~pycomm.parallel.plan.calibrate`, :mod:`~pycomm.parallel.plan.comms`,
  :mod:`~pycomm.parallel.plan.timing`: step time from measured compute and collectives;
- :mod:`~pycomm.parallel.plan.planner`: rank them; :func:`choose` is ``--plan auto``'s pick;
- :mod:`~pycomm.parallel.plan.cli`, :mod:`~pycomm.parallel.plan.report`: the command line and
  its table.

Example::

    python -m pycomm.parallel.plan --model gpt --n-layer 8 --n-embd 256 --world 4 --memory-gb 2
"""

from .layouts import Layout, enumerate_layouts
from .planner import Row, choose, evaluate

__all__ = ["Layout", "Row", "choose", "enumerate_layouts", "evaluate"]
