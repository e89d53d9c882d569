"""``ParallelConfig(compile=True)`` against eager in the same layout, on real batches
(``_real_batch_scenarios``): the losses and gradient norms of a few steps, and a model
compiled whole before ``parallelize`` (``tests/test_compile.py``)."""

from __future__ import annotations

import torch

from tests import _real_batch_scenarios as rb

STEPS = 2


def curves(layout: str, name: str, case: str) -> dict[str, list[tuple[float, float]]]:
    """Eager, compiled by the engine, and compiled whole by the user first."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, config = rb.LAYOUTS[layout]
    out = {}
    for how in ("eager", "compile", "compiled model"):
        mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
        model = rb.build(name)
        if how == "compiled model":
            model = torch.compile(model)
        engine = parallelize(model, mesh, ParallelConfig(
            max_grad_norm=rb.CLIP, optimizer_kwargs={"lr": rb.LR}, compile=how == "compile",
            **config))
        curve = []
        for step in range(STEPS):
            b = rb.batch(case, step)
            r = engine.train_step(b.tokens, b.targets, **b.inputs())
            curve.append((r.loss, r.grad_norm))
        out[how] = curve
        mesh.destroy()
    return out
