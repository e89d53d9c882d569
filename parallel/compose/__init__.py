"""Composition: every strategy of ``parallel/`` applied to one model on one device mesh.

The mesh (:mod:`.mesh`) gives every strategy its process group; a plan says what each
part of the model becomes; :func:`parallelize` applies the strategies in one fixed order
and returns the engine that trains this rank's part.

Example::

    from pycomm.parallel.compose import ParallelConfig, ParallelMesh, parallelize
    engine = parallelize(model, ParallelMesh(pp=2, dp=2, tp=2), ParallelConfig(zero=1))
"""

from ..mesh import ParallelMesh
from ..plans.plan import ContextRequest, Layer, Plan
from .config import ParallelConfig, StepResult
from .parallelize import ParallelModel, parallelize, plan_for

__all__ = ["ContextRequest", "Layer", "ParallelConfig", "ParallelMesh", "ParallelModel", "Plan",
           "StepResult", "parallelize", "plan_for"]
