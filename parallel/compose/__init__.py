"""Composition: every strategy of ``parallel/`` applied to one model on one device mesh.

The mesh (:mod:`.mesh`) gives every strategy its process group; a plan says what each
part of the model becomes; :func:`parallelize` applies the strategies in one fixed order
and returns the engine that trains this rank's part.
"""
