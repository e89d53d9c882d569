"""The layout planner: every (dp, tp, pp, ZeRO, recompute, P_a, offload) layout the
trainer accepts, with predicted per-rank memory and step time
(``python -m pycomm.parallel.planner``).

- :mod:`~pycomm.parallel.planner.shapes`: the model's parameters per layer, as its plan splits them;
- :mod:`~pycomm.parallel.planner.layouts`: the layouts, filtered by the project's own checks;
- :mod:`~pycomm.parallel.planner.memory`, :mod:`~pycomm.parallel.planner.activations`: bytes
  per rank;
- :mod:`~pycomm.parallel.planner.calibrate`, :mod:`~pycomm.parallel.planner.collective_times`,
  :mod:`~pycomm.parallel.planner.timing`: step time from measured compute and collectives;
- :mod:`~pycomm.parallel.planner.planner`: rank them; :func:`choose` is ``--plan auto``'s pick;
- :mod:`~pycomm.parallel.planner.cli`, :mod:`~pycomm.parallel.planner.report`: the command line and
  its table.

Example::

    python -m pycomm.parallel.planner --model gpt --n-layer 8 --n-embd 256 --world 4 --memory-gb 2
"""

from .layouts import Layout, enumerate_layouts
from .planner import Row, choose, evaluate

__all__ = ["Layout", "Row", "choose", "enumerate_layouts", "evaluate"]
