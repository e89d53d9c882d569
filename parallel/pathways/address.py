"""Where a cluster listens: its store, its islands' schedulers, and the key to talk to them.

``str(address)`` is a line a second controller (another process, another host) passes
to ``Client`` to attach to the same cluster.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster's store and island schedulers listen, and its key."""

    store: tuple[str, int]
    schedulers: tuple[tuple[str, int], ...]
    sizes: tuple[int, ...]
    authkey: str  # hex

    def __str__(self) -> str:
        s = ",".join(f"{h}:{p}" for h, p in self.schedulers)
        return (f"pw://{self.store[0]}:{self.store[1]}/{s}/"
                f"{','.join(map(str, self.sizes))}/{self.authkey}")

    @classmethod
    def parse(cls, text: str) -> ClusterAddress:
        """The address ``str(address)`` printed (for a controller in another process)."""
        if not text.startswith("pw://"):
            raise ValueError(f"not a pathways address: {text!r}")
        store, schedulers, sizes, key = text.removeprefix("pw://").split("/")
        return cls(_host_port(store), tuple(_host_port(s) for s in schedulers.split(",")),
                   tuple(int(n) for n in sizes.split(",")), key)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)
