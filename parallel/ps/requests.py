"""What a server checks of a request before it touches a table: the table was declared,
the keys and values are what the table takes (decoded first when compressed on the
wire). A request that fails is answered with the message; the server goes on.
"""

from __future__ import annotations

from typing import Any

import torch

from .filters import decode
from .store import Table


class RequestError(ValueError):
    """A worker's request is wrong: answered with the message, the server goes on."""


def _table(tables: dict[str, Table], name: Any) -> Table:
    if name not in tables:
        raise RequestError(f"table {name!r} was never declared (declared: "
                           f"{sorted(tables)[:10]})")
    return tables[name]


def checked_request(tables: dict[str, Table], header: dict[str, Any],
                    tensors: list[torch.Tensor], values: bool
                    ) -> tuple[Table, torch.Tensor, torch.Tensor | None]:
    """The table a request names, its keys and (``values``) its values, decoded and
    checked: 1-D int64 keys, sorted and unique; float32 values of keys x the table's dim."""
    table = _table(tables, header.get("table"))
    if values and "codec" in header and len(tensors) > 1:  # compressed on the wire
        try:
            frames = [t.numpy().tobytes() for t in tensors[1:]]
            tensors = [tensors[0], decode(list(frames), header["codec"])]
        except ValueError as e:
            raise RequestError(f"table {table.spec.name!r}: {e}") from None
    if len(tensors) != (2 if values else 1):
        raise RequestError(f"table {table.spec.name!r}: expected "
                           f"{'keys and values' if values else 'keys'}, got "
                           f"{len(tensors)} tensors")
    keys = tensors[0]
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise RequestError(f"table {table.spec.name!r}: keys must be 1-D int64, got "
                           f"{keys.dtype} {list(keys.shape)}")
    if len(keys) > 1 and not bool((keys[1:] > keys[:-1]).all()):
        raise RequestError(f"table {table.spec.name!r}: keys must be sorted and unique")
    vals = None
    if values:
        vals = tensors[1]
        want = [len(keys), table.spec.dim]
        if vals.dtype != torch.float32 or list(vals.shape) != want:
            raise RequestError(f"table {table.spec.name!r}: values must be float32 "
                               f"{want} (keys x dim), got {vals.dtype} {list(vals.shape)}")
    return table, keys, vals
