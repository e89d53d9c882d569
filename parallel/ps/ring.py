"""Which servers hold a key: consistent hashing with virtual nodes (Karger et al.; the
parameter server's §4.3).

Each server owns ``vnodes`` points on a 64-bit ring; a key hashes to a point and belongs
to the next server point clockwise (its primary), and is replicated on the next
``replicas`` distinct servers after it. Adding or removing one server moves only the
keys next to its points: about 1/S of the key space.
"""

from __future__ import annotations

import hashlib

from .._optional import missing

try:
    import numpy as np
except ModuleNotFoundError as err:
    raise missing("numpy", "pycomm.parallel.ps (the parameter server's key ring)", err) from err
import torch


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread hash of uint64 values."""
    x = x.copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _salt(text: str) -> np.uint64:
    """A stable 64-bit hash of a name (Python's hash() is salted per process)."""
    return np.uint64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                                    "little"))


def key_points(table: str, keys: torch.Tensor) -> np.ndarray:
    """Each key's point on the ring (the table's name salts it: tables spread alike)."""
    return _mix(keys.numpy().astype(np.uint64) ^ _salt(table))


class Ring:
    """The servers ``ids`` (stable integers; a dead one is left out) on the ring."""

    def __init__(self, ids: list[int], replicas: int = 0, vnodes: int = 64):
        if not ids:
            raise ValueError("ring: no servers")
        self.ids, self.vnodes = sorted(ids), vnodes
        self.replicas = min(replicas, len(ids) - 1)
        points = [(_mix(np.array([_salt(f"server{s}") + np.uint64(v)], dtype=np.uint64))[0], s)
                  for s in self.ids for v in range(vnodes)]
        points.sort()
        self._points = np.array([p for p, _ in points], dtype=np.uint64)
        self._owner = np.array([s for _, s in points], dtype=np.int64)
        self._chains = self._chain_table()

    def _chain_table(self) -> np.ndarray:
        """For every ring point: its server, then the next ``replicas`` distinct ones."""
        n, width = len(self._owner), 1 + self.replicas
        chains = np.empty((n, width), dtype=np.int64)
        for i in range(n):
            chain: list[int] = []
            j = i
            while len(chain) < width:
                s = int(self._owner[j % n])
                if s not in chain:
                    chain.append(s)
                j += 1
            chains[i] = chain
        return chains

    def holders(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """(n, 1 + replicas) server ids per key: the primary first, then its replicas."""
        at = np.searchsorted(self._points, key_points(table, keys), side="left")
        return torch.from_numpy(self._chains[at % len(self._points)])

    def primary(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        return self.holders(table, keys)[:, 0]

    def spec(self) -> dict:
        return {"ids": self.ids, "replicas": self.replicas, "vnodes": self.vnodes}

    @staticmethod
    def from_spec(spec: dict) -> Ring:
        return Ring(list(spec["ids"]), spec["replicas"], spec["vnodes"])


def handover(old: Ring, new: Ring, table: str, keys: torch.Tensor, sid: int
             ) -> dict[int, torch.Tensor]:
    """What server ``sid`` sends when the ring changes from ``old`` to ``new``: for each
    server that holds some of ``keys`` under ``new`` but not under ``old``, the mask of
    those keys whose first surviving old holder is ``sid`` (one sender per key)."""
    before, after = old.holders(table, keys), new.holders(table, keys)
    alive = torch.isin(before, torch.tensor(new.ids))
    first = torch.where(alive, before, torch.full_like(before, -1))
    sender = first.gather(1, alive.int().argmax(dim=1, keepdim=True)).squeeze(1)
    mine = sender == sid
    out = {}
    for target in set(after.flatten().tolist()) - {sid}:
        lacks = (after == target).any(dim=1) & ~(before == target).any(dim=1) & mine
        if bool(lacks.any()):
            out[target] = lacks
    return out
