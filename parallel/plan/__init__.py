"""The layout planner: every (dp, tp, pp, ZeRO, recompute, P_a, offload) layout the
trainer accepts, with predicted per-rank memory and step time (``python -m parallel.plan``).

- :mod:`~parallel.plan.shapes`: the model's parameters per layer, as its plan splits them;
- :mod:`~parallel.plan.layouts`: the layouts, filtered by the project's own checks;
- :mod:`~parallel.plan.memory`, :mod:`~parallel.plan.activations`: bytes per rank;
- :mod:`~parallel.plan.calibrate`, :mod:`~parallel.plan.comms`,
  :mod:`~parallel.plan.timing`: step time from measured compute and collectives;
- :mod:`~parallel.plan.planner`: rank them; :func:`choose` is ``--plan auto``'s pick;
- :mod:`~parallel.plan.cli`, :mod:`~parallel.plan.report`: the command line and its table.

Example::

    python -m parallel.plan --model gpt --n-layer 8 --n-embd 256 --world 4 --memory-gb 2
"""

from parallel.plan.layouts import Layout, enumerate_layouts
from parallel.plan.planner import Row, choose, evaluate

__all__ = ["Layout", "Row", "choose", "enumerate_layouts", "evaluate"]
