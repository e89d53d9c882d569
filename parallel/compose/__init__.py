"""Composition: every strategy of ``parallel/`` applied to one model on one device mesh.

The mesh (:mod:`.mesh`) gives every strategy its process group; a plan says what each
part of the model becomes; :func:`parallelize` applies the strategies in one fixed order
and returns the engine that trains this rank's part.

Example::

    from . import ParallelConfig, ParallelMesh, parallelize
    engine = parallelize(model, ParallelMesh(pp=2, dp=2, tp=2), ParallelConfig(zero=1))
"""

from .config import ParallelConfig, StepResult
from .mesh import ParallelMesh
from .parallelize import ParallelModel, parallelize, plan_for
from .plan import ContextRequest, Layer, Plan

__all__ = ["ContextRequest", "Layer", "ParallelConfig", "ParallelMesh", "ParallelModel", "Plan",
           "StepResult", "parallelize", "plan_for"]
