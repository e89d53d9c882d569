"""What a function sees of its mesh on one worker: the mesh's groups, by dimension name.

A function runs SPMD on every rank of its mesh and talks to the others through these
groups (``dist.all_reduce(x, group=ctx.group("dp"))``), or through ``ctx.device_mesh``
(torch's ``DeviceMesh`` built from the same groups, for DTensor and FSDP2).

Every worker of the island makes every group of every mesh, members or not, in the
island scheduler's one order: torch names a group by how many groups its process has
made, so only a history the island's workers share gives every member the same name.
A released mesh's groups are kept and handed to the next mesh over the same ranks (a
remade group would meet its predecessor's keys in the store); every worker sees the
same releases, so they agree on which.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Slot = tuple[tuple[int, ...], int]  # (ranks, which of the groups over those ranks)


class GroupPool:
    """The island's groups by rank set, each in use by a mesh or free (the same on every
    worker of the island)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], list[Any]] = {}
        self._busy: set[Slot] = set()

    def take(self, ranks: tuple[int, ...]) -> tuple[Slot, Any]:
        """A free group over ``ranks`` (made now if there is none): collective over the
        island, every worker calling it with the same ``ranks`` in the same order."""
        groups = self._groups.setdefault(ranks, [])
        for i, group in enumerate(groups):
            if (ranks, i) not in self._busy:
                self._busy.add((ranks, i))
                return (ranks, i), group
        groups.append(dist.new_group(list(ranks)))
        self._busy.add((ranks, len(groups) - 1))
        return (ranks, len(groups) - 1), groups[-1]

    def give_back(self, slots: list[Slot]) -> None:
        self._busy.difference_update(slots)


class MeshGroups:
    """Every group of one mesh, made on every worker of the island (see the module)."""

    def __init__(self, pool: GroupPool, ranks: tuple[int, ...], shape: tuple[int, ...]):
        self.pool, self.ranks, self.shape = pool, ranks, shape
        self.slots: list[Slot] = []
        self.whole = self._take(ranks)
        grid = torch.tensor(ranks).view(shape)
        self.by_dim: list[dict[tuple[int, ...], Any]] = []
        for dim in range(len(shape)):
            lines = grid.movedim(dim, -1).reshape(-1, shape[dim])
            self.by_dim.append({tuple(int(r) for r in line): None for line in lines})
            for line in self.by_dim[-1]:
                self.by_dim[-1][line] = self.whole if line == ranks else self._take(line)

    def _take(self, ranks: tuple[int, ...]) -> Any:
        slot, group = self.pool.take(ranks)
        self.slots.append(slot)
        return group

    def release(self, reuse: bool = True) -> None:
        """The mesh is gone: its groups go back to the pool, unless they may have been
        aborted (then they stay taken, on every worker alike, and are never reused)."""
        if reuse:
            self.pool.give_back(self.slots)


class MeshContext:
    """One mesh as one of its ranks sees it.

    Attributes:
        island: the island the mesh lies in.
        ranks: the mesh's ranks (of the island's process group), in mesh order.
        shape, names: the mesh's dimensions.
        index: this rank's position in ``ranks``; ``coords`` its coordinate per dimension.
    """

    def __init__(self, island: int, groups: MeshGroups, names: tuple[str, ...]):
        self.island, self.ranks, self.shape, self.names = (
            island, groups.ranks, groups.shape, names)
        self.index = self.ranks.index(dist.get_rank())
        self.coords = dict(zip(names, _unravel(self.index, self.shape), strict=True))
        grid = torch.tensor(self.ranks).view(self.shape)
        self._whole = groups.whole
        self._dims = {n: groups.by_dim[d][_slice(grid, d, self.coords)]
                      for d, n in enumerate(names)}
        self._device_mesh: DeviceMesh | None = None
        self.broken: str | None = None  # why the mesh is refused (its groups aborted)

    def abort(self) -> None:
        """Abort every group of the mesh that holds this rank (waits on them end)."""
        for group in {id(g): g for g in (self._whole, *self._dims.values())}.values():
            group.abort()

    def group(self, name: str | None = None) -> Any:
        """The group along dimension ``name``, or of the whole mesh (``None``)."""
        if name is None:
            return self._whole
        if name not in self._dims:
            raise KeyError(f"mesh {self.names}: no dimension {name!r}")
        return self._dims[name]

    def size(self, name: str | None = None) -> int:
        return math.prod(self.shape) if name is None else self.shape[self.names.index(name)]

    def rank(self, name: str | None = None) -> int:
        """This rank's coordinate along ``name`` (its position in the mesh: ``None``)."""
        return self.index if name is None else self.coords[name]

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's ``DeviceMesh`` on these groups (device type ``cpu``)."""
        if self._device_mesh is None:
            self._device_mesh = DeviceMesh.from_group(
                [self._dims[n] for n in self.names], "cpu",
                mesh=torch.tensor(self.ranks).view(self.shape), mesh_dim_names=self.names)
        return self._device_mesh

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))
        return f"MeshContext(island {self.island}, ranks {list(self.ranks)}, {dims})"


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


def _slice(grid: torch.Tensor, dim: int, coords: dict[str, int]) -> tuple[int, ...]:
    """The ranks along ``dim`` through this rank: every other coordinate held fixed."""
    at = list(coords.values())
    index = tuple(slice(None) if d == dim else at[d] for d in range(grid.dim()))
    return tuple(int(r) for r in grid[index].reshape(-1))


__all__ = ["GroupPool", "MeshContext", "MeshGroups"]
