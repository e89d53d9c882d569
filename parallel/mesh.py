"""The job's (pp, dp, tp) device mesh: every strategy's process group, built and checked once.

Ranks are laid out as torch's ``DeviceMesh`` lays out a ``(pp, dp, tp)`` shape, tensor
parallelism innermost (as Megatron-LM): the ``tp`` ranks of one model replica and stage
are consecutive, the ``dp`` replicas of a stage next, the pipeline stages outermost.
Every strategy takes its group from here, so groups agree with each other by
construction: the pipeline neighbour of a rank has its ``dp`` and ``tp`` coordinates.

Expert parallelism (``ep``) is drawn from ``dp``, as torchtitan borrows it from the
data-parallel dimension: the data-parallel ranks of a stage form ``dp / ep`` groups of
``ep`` consecutive ranks (``"ep"``: they split the experts and exchange tokens), and the
ranks holding the same experts form the expert-data-parallel group (``"edp"``), which
reduces (and under ZeRO shards) the experts' gradients and state.

Example::

    dist.init_process_group("pycomm")
    mesh = ParallelMesh(pp=1, dp=2, tp=2)          # 4 ranks
    mesh.group("tp"), mesh.rank("dp"), mesh.size("pp")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "tp")
EXPERT_DIMS = ("ep", "edp")  # drawn from dp


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the pipeline, data-parallel and tensor-parallel dimensions."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        bad = [f"{d}={getattr(self, d)!r}" for d in (*DIMS, "ep")
               if not isinstance(getattr(self, d), int) or getattr(self, d) < 1]
        if bad:
            raise ValueError(f"mesh: every dimension must be a positive int, got {', '.join(bad)}")
        if self.dp % self.ep:
            raise ValueError(f"mesh: ep({self.ep}) must divide dp({self.dp}): expert "
                             "parallelism is drawn from the data-parallel ranks")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def check_world(self, world: int) -> None:
        """Raises ValueError naming every factor unless they multiply to ``world``."""
        if self.world != world:
            raise ValueError(f"mesh: pp({self.pp}) * dp({self.dp}) * tp({self.tp}) = "
                             f"{self.world} != WORLD_SIZE({world})")

    def __str__(self) -> str:
        ep = f" (ep{self.ep})" if self.ep > 1 else ""
        return f"pp{self.pp} x dp{self.dp}{ep} x tp{self.tp}"


class ParallelMesh:
    """The groups of a ``(pp, dp, tp)`` job, on torch's ``DeviceMesh``.

    Collective: every rank of the default group constructs it with the same shape.

    Args:
        pp, dp, tp: the dimensions' sizes; their product must be the world size.
        ep: expert parallelism, drawn from ``dp`` (see the module docstring).
        device_type: the mesh's device type (``"cpu"`` for pycomm's shared memory).

    Raises:
        ValueError: a dimension that is not a positive int, or sizes that do not
            multiply to the world size (raised on every rank, before any group exists).
    """

    def __init__(self, pp: int = 1, dp: int = 1, tp: int = 1, device_type: str = "cpu",
                 ep: int = 1):
        self.shape = MeshShape(pp, dp, tp, ep)
        self.shape.check_world(dist.get_world_size())
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, (pp, dp, tp), mesh_dim_names=DIMS)
        self._groups = {d: self.device_mesh.get_group(d) for d in DIMS}
        coords = self.device_mesh.get_coordinate()
        assert coords is not None  # every rank of the world is in the mesh
        self._coords = dict(zip(DIMS, coords, strict=True))
        self._expert_groups(device_type)

    def _expert_groups(self, device_type: str) -> None:
        """``ep`` and ``edp``: a data-parallel rank ``d`` is expert rank ``d % ep`` of
        expert-data-parallel rank ``d // ep`` (a second mesh over the same ranks:
        ``(pp, dp / ep, ep, tp)``)."""
        ep, dp = self.shape.ep, self.shape.dp
        if ep == 1:  # the experts are whole on every data-parallel rank: no ep group
            self._groups["edp"] = self._groups["dp"]
            self._coords.update(ep=0, edp=self._coords["dp"])
            return
        pp, tp = self.shape.pp, self.shape.tp
        rank_of = self.global_rank
        ep_groups = [[rank_of(s, e * ep + i, t) for i in range(ep)]
                     for s in range(pp) for e in range(dp // ep) for t in range(tp)]
        edp_groups = [[rank_of(s, e * ep + i, t) for e in range(dp // ep)]
                      for s in range(pp) for i in range(ep) for t in range(tp)]
        self._groups["ep"] = dist.new_subgroups_by_enumeration(ep_groups)[0]
        self._groups["edp"] = dist.new_subgroups_by_enumeration(edp_groups)[0]
        self._coords.update(ep=self._coords["dp"] % ep, edp=self._coords["dp"] // ep)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group along ``dim`` that holds this rank.

        Raises:
            KeyError: ``"ep"`` on a mesh without expert parallelism (ep = 1).
        """
        if _checked(dim) not in self._groups:
            raise KeyError(f"mesh: no {dim} group: {self.shape} has no expert parallelism")
        return self._groups[dim]

    def size(self, dim: str) -> int:
        if _checked(dim) == "edp":
            return self.shape.dp // self.shape.ep
        return int(getattr(self.shape, dim))

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self._coords[_checked(dim)]

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """This rank's ``(pp, dp, tp)`` coordinates."""
        return self._coords["pp"], self._coords["dp"], self._coords["tp"]

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        """The world rank at coordinates ``(pp, dp, tp)``."""
        return (pp * self.shape.dp + dp) * self.shape.tp + tp

    def destroy(self) -> None:
        """Destroy this mesh's process groups (a job that builds several meshes)."""
        for group in {id(g): g for g in self._groups.values()}.values():  # (edp may be dp)
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        self._groups = {}

    def __repr__(self) -> str:
        pp, dp, tp = self.coordinates
        return f"ParallelMesh({self.shape}; this rank at pp={pp} dp={dp} tp={tp})"


def _checked(dim: str) -> str:
    if dim not in DIMS + EXPERT_DIMS:
        raise KeyError(f"mesh: no dimension {dim!r}; the dimensions are {DIMS + EXPERT_DIMS}")
    return dim
