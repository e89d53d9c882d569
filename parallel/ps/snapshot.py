"""A server's part of a job checkpoint: the rows it leads (so each key is written once
in the job), and, on restart, the rows a server holds under the new ring, from every
file (the new job may have another number of servers)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from .ring import Ring
from .store import Rows, Table, TableSpec


def write(path: str, sid: int, tables: dict[str, Table], ring: Ring) -> None:
    out = {}
    for name, table in tables.items():
        lead = ring.primary(name, table.keys) == sid
        out[name] = {"spec": table.spec.as_dict(), "rows": table.take(lead).__dict__}
    tmp = os.path.join(path, f"server{sid}.pt.partial")
    torch.save({"tables": out}, tmp)
    os.replace(tmp, tmp.removesuffix(".partial"))  # whole or absent


def held_rows(files: list[str], ring: Ring, sid: int) -> Iterator[tuple[TableSpec, Rows]]:
    """Each saved table's rows that ``sid`` holds under ``ring``, with push numbers
    forgotten (the new job's workers number their pushes from 1 again)."""
    for path in files:
        saved = torch.load(path, weights_only=False)
        for entry in saved["tables"].values():
            rows = Rows(**entry["rows"])
            mine = rows.subset((ring.holders(entry["spec"]["name"], rows.keys) == sid
                                ).any(dim=1))
            mine.seen = torch.full_like(mine.seen, -1)
            yield TableSpec.from_dict(entry["spec"]), mine
