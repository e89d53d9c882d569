"""Every layout the trainer accepts for a world size: dp x tp x pp, ZeRO stage,
recompute, ``P_a`` and offload, each kept only where the project's own checks pass
(:meth:`TrainConfig.check`, :meth:`ParallelConfig.check`, the plan's divisibility and
the pipeline's balance), so the planner never lists what ``pycomm.parallel.train`` refuses."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ..mesh import MeshShape
from .shapes import ModelShape

OFFLOADS = ("none", "disk")


@dataclass(frozen=True)
class Layout:
    """One way to lay a job out (the trainer's flags of the same names)."""

    dp: int
    tp: int
    pp: int
    zero: int
    recompute: bool
    partition_activations: bool
    offload: str = "none"
    microbatches: int = 1  # the pipeline's M (the trainer's default: pp)
    ep: int = 1  # experts split over ep ranks drawn from dp (the mesh's "ep")

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts (the mesh's ``"edp"``)."""
        return self.dp // self.ep

    def __str__(self) -> str:
        parts = [f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["recompute"] if self.recompute else []
        parts += ["P_a"] if self.partition_activations else []
        parts += [f"offload={self.offload}"] if self.offload != "none" else []
        return " ".join(parts)

    def flags(self) -> list[str]:
        """The trainer's flags for this layout."""
        out = [f"--dp={self.dp}", f"--tp={self.tp}", f"--pp={self.pp}", f"--zero={self.zero}",
               "--recompute" if self.recompute else "--no-recompute",
               "--partition-activations" if self.partition_activations
               else "--no-partition-activations"]
        out += [f"--ep={self.ep}"] if self.ep > 1 else []
        return out + ([f"--offload={self.offload}"] if self.offload != "none" else [])


class _ShapeMesh:
    """What :meth:`ParallelConfig.check` reads of a mesh (its sizes), without groups."""

    def __init__(self, shape: MeshShape):
        self.shape = shape

    def size(self, dim: str) -> int:
        return int(getattr(self.shape, dim))


def offload_supported() -> bool:
    """Whether this checkout's trainer has an ``offload`` setting."""
    from ..job.config import TrainConfig

    return "offload" in {f.name for f in dataclasses.fields(TrainConfig)}


def meshes(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) whose product is ``world``."""
    return [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) if world % dp == 0
            for tp in range(1, world // dp + 1) if (world // dp) % tp == 0]


def with_layout(cfg: Any, layout: Layout) -> Any:
    """``cfg`` (a :class:`TrainConfig`) with ``layout``'s settings."""
    changes: dict[str, Any] = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
                               "zero": layout.zero, "recompute": layout.recompute,
                               "partition_activations": layout.partition_activations,
                               "nproc": 0, "plan": "", "ep": layout.ep}
    if layout.offload != "none" or offload_supported():
        changes["offload"] = layout.offload
    return dataclasses.replace(cfg, **changes)


def refusal(cfg: Any, layout: Layout, shape: ModelShape) -> str | None:
    """Why the trainer would refuse ``layout`` (None: it accepts it): the first
    ValueError of the project's own checks, or a TypeError for a setting it lacks."""
    from ..job.config import parallel_config

    if layout.offload != "none" and not offload_supported():
        return f"offload={layout.offload}: this checkout's pycomm.parallel.train has no --offload"
    precision = getattr(cfg, "precision", "fp32")
    if precision != "fp32" and layout.zero != 3:
        return (f"plan: precision {precision} is modelled at zero=3 only (the trainer runs "
                f"zero={layout.zero} in {precision}; the planner cannot predict its memory)")
    try:
        run = with_layout(cfg, layout)
        run.check()
        config = parallel_config(run)
        config.check(_ShapeMesh(run.layout))  # type: ignore[arg-type]
        shape.check_tp(layout.tp)
        shape.balance(layout.pp)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def candidates(world: int, offloads: tuple[str, ...] = OFFLOADS,
               experts: bool = False) -> list[Layout]:
    """Every combination of the dimensions, valid or not (with ``experts``, every ep
    dividing dp too)."""
    out = []
    for dp, tp, pp in meshes(world):
        eps = [e for e in range(1, dp + 1) if dp % e == 0] if experts else [1]
        for zero, ep in itertools.product((0, 1, 2, 3), eps):
            for recompute, pa in ((False, False), (True, False), (True, True), (False, True)):
                for offload in offloads:
                    out.append(Layout(dp, tp, pp, zero, recompute, pa, offload, ep=ep))
    return out


def enumerate_layouts(cfg: Any, world: int, shape: ModelShape,
                      offloads: tuple[str, ...] = OFFLOADS
                      ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """The layouts the trainer accepts for ``world`` ranks, and those it refuses with
    why. Micro-batches follow ``cfg.microbatches`` (0: the trainer's default, pp)."""
    accepted, refused = [], []
    for layout in candidates(world, offloads, shape.has_experts):
        layout = dataclasses.replace(layout, microbatches=cfg.microbatches or layout.pp)
        why = refusal(cfg, layout, shape)
        if why is None:
            accepted.append(layout)
        else:
            refused.append((layout, why))
    return accepted, refused
