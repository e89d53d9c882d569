"""The process's default controller, for scripts: ``pw.init``, ``pw.mesh``, ``pw.shutdown``.

As ``ray.init`` does: ``pw.init(islands=[4, 4])`` starts a cluster on this host (or
``pw.init(address)`` attaches to a running one) and a client on it; ``pw.mesh(...)``
then asks that client for a mesh. Code that drives several clusters, or several
clients, uses :class:`~pycomm.parallel.pathways.cluster.Cluster` and
:class:`~pycomm.parallel.pathways.client.Client` directly.
"""

from __future__ import annotations

from typing import Any

from .address import ClusterAddress
from .client import Client, Mesh
from .cluster import Cluster

_state: dict[str, Any] = {}


def init(address: ClusterAddress | str | None = None, islands: list[int] | None = None,
         **client_options: Any) -> Client:
    """The default client: on a new local cluster of ``islands``, or on ``address``.

    Raises:
        RuntimeError: if there is one already (``shutdown()`` first).
        ValueError: neither or both of ``address`` and ``islands``.
    """
    if _state:
        raise RuntimeError("pathways: init() was called already; shutdown() first")
    if (address is None) == (islands is None):
        raise ValueError("pathways.init: give the address of a cluster, or islands to start")
    cluster = Cluster(islands) if islands is not None else None
    target = cluster.address if cluster is not None else address
    assert target is not None
    _state["client"] = Client(target, **client_options)
    _state["cluster"] = cluster
    return _state["client"]


def client() -> Client:
    """The default client (RuntimeError before ``init()``)."""
    if "client" not in _state:
        raise RuntimeError("pathways: no default client; call pathways.init() first")
    return _state["client"]


def mesh(island: int = 0, shape: tuple[int, ...] | int = 1,
         names: tuple[str, ...] | None = None, ranks: list[int] | None = None) -> Mesh:
    """A mesh from the default client (see :meth:`Client.mesh`)."""
    return client().mesh(island, shape, names, ranks)


def shutdown() -> None:
    """Close the default client, and the cluster ``init`` started, if it did."""
    if not _state:
        return
    _state.pop("client").close()
    cluster = _state.pop("cluster")
    if cluster is not None:
        cluster.close()
