"""Pathways (Barham et al., MLSys 2022): one controller over islands of workers.

The controller is the user's own Python process. It asks islands (the ranks of one host:
pycomm's shared memory inside, gloo between) for virtual meshes, and calls functions on
them; every call returns futures at once, the outputs stay on the workers and move
worker to worker, and reach the controller only when it asks. Each island's scheduler
gives every function of every controller one order (gang scheduling), so programs that
share workers never deadlock, and clients share an island by weight.

Example::

    import torch, torch.distributed as dist
    from pycomm.parallel import pathways as pw

    @pw.function(out=pw.spec((4,), torch.float64))
    def summed(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=ctx.group())
        return x

    pw.init(islands=[2, 2])                  # or pw.init(address) of a running cluster
    mesh = pw.mesh(island=0, shape=(2,), names=("dp",))
    y = summed(mesh, torch.ones(4, dtype=torch.float64))   # returns at once
    print(y.result(0))                                      # tensor([2., 2., 2., 2.])
    pw.shutdown()

``pw.Cluster`` and ``pw.Client`` are the same without a process-wide default (several
clusters, several clients, a second controller attached by ``str(cluster.address)``).
"""

from .address import ClusterAddress
from .client import Client, Mesh
from .cluster import Cluster
from .default import client, init, mesh, shutdown
from .functions import Function, function
from .futures import Future, PathwaysError, Shard
from .launch import Launcher, LocalLauncher, WorkerSpec
from .mesh_context import MeshContext
from .protocol import Spec, spec

__all__ = ["Client", "Cluster", "ClusterAddress", "Function", "Future", "Launcher",
           "LocalLauncher", "Mesh", "MeshContext", "PathwaysError", "Shard", "Spec",
           "WorkerSpec", "client", "function", "init", "mesh", "shutdown", "spec"]
