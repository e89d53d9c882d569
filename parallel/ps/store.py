"""A server's share of one table: the keys it holds (sorted), their value vectors, the
update rule's state, and for each key how many pushes were applied and the last push
sequence number seen from each worker (so a push resent after a failure is applied
once).

Rows move between servers (replication, a server leaving or joining) as a
:class:`Rows` bundle of all of these, so nothing about a key is left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .updaters import Updater, make_updater


@dataclass
class TableSpec:
    name: str
    dim: int
    updater: dict[str, Any]
    init: str  # "zeros", or "none": a key must be set (or pushed) before it is pulled

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "updater": self.updater, "init": self.init}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TableSpec:
        spec = TableSpec(str(d["name"]), int(d["dim"]), dict(d["updater"]), str(d["init"]))
        if spec.dim <= 0 or spec.init not in ("zeros", "none"):
            raise ValueError(f"table {spec.name!r}: dim must be > 0 and init 'zeros' or "
                             f"'none' (got dim={spec.dim}, init={spec.init!r})")
        return spec


@dataclass
class Rows:
    """Everything a table holds about some keys (the unit that migrates)."""

    keys: torch.Tensor  # int64 (n,), sorted
    values: torch.Tensor  # (n, dim)
    state: dict[str, torch.Tensor]
    applied: torch.Tensor  # int64 (n,)
    seen: torch.Tensor  # int64 (n, workers)

    def subset(self, mask: torch.Tensor) -> Rows:
        return Rows(self.keys[mask], self.values[mask],
                    {n: t[mask] for n, t in self.state.items()}, self.applied[mask],
                    self.seen[mask])

    def tensors(self, state_names: list[str]) -> list[torch.Tensor]:
        return [self.keys, self.values, self.applied, self.seen,
                *(self.state[n] for n in state_names)]

    @staticmethod
    def from_tensors(ts: list[torch.Tensor], state_names: list[str]) -> Rows:
        keys, values, applied, seen, *state = ts
        return Rows(keys, values, dict(zip(state_names, state, strict=True)), applied, seen)


class Table:
    def __init__(self, spec: TableSpec, workers: int):
        self.spec, self.workers = spec, workers
        self.updater: Updater = make_updater(spec.updater)
        self.columns = self.updater.state_columns(spec.dim)
        self.keys = torch.empty(0, dtype=torch.int64)
        self.values = torch.empty(0, spec.dim)
        self.state = {n: torch.empty(0, c) for n, c in self.columns.items()}
        self.applied = torch.empty(0, dtype=torch.int64)
        self.seen = torch.empty(0, workers, dtype=torch.int64)

    @property
    def state_names(self) -> list[str]:
        return sorted(self.columns)

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, present): each key's row, and whether the table holds it."""
        rows = torch.searchsorted(self.keys, keys).clamp_(max=max(len(self.keys) - 1, 0))
        present = (self.keys[rows] == keys) if len(self.keys) else torch.zeros_like(keys,
                                                                                   dtype=torch.bool)
        return rows, present

    def rows_for(self, keys: torch.Tensor, create: bool) -> torch.Tensor:
        """The rows of ``keys`` (sorted unique), inserting missing ones when ``create``
        (values zero, state as the rule starts it)."""
        rows, present = self.find(keys)
        if bool(present.all()):
            return rows
        missing = keys[~present]
        if not create:
            shown = missing[:8].tolist()
            raise KeyError(f"table {self.spec.name!r}: {len(missing)} key(s) never pushed or "
                           f"set, e.g. {shown} (the table was declared with init='none')")
        self.insert(self.fresh(missing))
        return self.find(keys)[0]

    def fresh(self, keys: torch.Tensor) -> Rows:
        n = len(keys)
        return Rows(keys, torch.zeros(n, self.spec.dim),
                    self.updater.init_state(n, self.spec.dim),
                    torch.zeros(n, dtype=torch.int64),
                    torch.full((n, self.workers), -1, dtype=torch.int64))

    def insert(self, rows: Rows) -> None:
        """Add rows for keys not held yet (a key already held keeps its row)."""
        _, present = self.find(rows.keys)
        new = ~present
        keys = torch.cat([self.keys, rows.keys[new]])
        order = torch.argsort(keys)
        self.keys = keys[order]
        self.values = torch.cat([self.values, rows.values[new]])[order]
        self.state = {n: torch.cat([t, rows.state[n][new]])[order] for n, t in self.state.items()}
        self.applied = torch.cat([self.applied, rows.applied[new]])[order]
        self.seen = torch.cat([self.seen, rows.seen[new]])[order]

    def take(self, mask: torch.Tensor) -> Rows:
        """A copy of the rows where ``mask`` holds."""
        return Rows(self.keys[mask], self.values[mask].clone(),
                    {n: t[mask].clone() for n, t in self.state.items()},
                    self.applied[mask].clone(), self.seen[mask].clone())

    def drop(self, mask: torch.Tensor) -> None:
        keep = ~mask
        self.keys, self.values = self.keys[keep], self.values[keep]
        self.state = {n: t[keep] for n, t in self.state.items()}
        self.applied, self.seen = self.applied[keep], self.seen[keep]

    def fresh_rows(self, rows: torch.Tensor, worker: int, seq: int) -> torch.Tensor:
        """Which of ``rows`` have not yet seen push ``seq`` of ``worker`` (a resent push
        is applied once)."""
        return self.seen[rows, worker] < seq

    def record(self, rows: torch.Tensor, worker: int, seq: int) -> None:
        self.applied[rows] += 1
        self.seen[rows, worker] = seq

    def update(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        self.updater.apply(self.values, self.state, rows, grads)
