"""gloo as a benchmark peer at the settings its own users can reach.

torch's gloo has one transport here (TCP: ``GLOO_DEVICE_TRANSPORT`` accepts only TCP in
this build) and three knobs a gloo user tunes: the worker threads of a process group
(``ProcessGroupGloo._Options._threads``, 2 by default), how many devices (TCP contexts,
each with its own event loop) a group spreads its pairs over (``_devices``, 1), and the
interface its sockets bind (``GLOO_SOCKET_IFNAME``; by default the hostname's address).
Pinning is the job's (``--bind``, and a pinned and an unpinned run with ``--tuned``).

``gloo`` is torch's default group (``dist.new_group(backend="gloo")``, what a trainer
gets); each variant below builds a ProcessGroupGloo with its options on the default
store and is driven through the backend's own calls (torch's Python wrapper costs a few
microseconds, gloo's calls here hundreds). The best per size over all of them counts
(bench._best).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOptions,
    ReduceScatterOptions,
)

from bench._timing import REDOPS, ROOT, Buffers

# label -> (threads, devices, interface); "" = the hostname's address, as torch's default
VARIANTS: dict[str, tuple[int, int, str]] = {
    "gloo-1t": (1, 1, ""),  # one worker thread: one fewer thread to wake per call
    "gloo-4t": (4, 1, ""),
    "gloo-2d": (2, 2, ""),  # two TCP contexts, two event loops
    "gloo-lo": (2, 1, "lo"),  # sockets bound to the loopback interface by name
}
_made = 0  # groups made by this process: their store prefixes, the same order on every rank


def _device(interface: str):
    if interface:
        return ProcessGroupGloo.create_device(interface=interface)
    return ProcessGroupGloo.create_default_device()


class GlooComm:
    """One gloo variant as the timing loop sees it (see bench._timing.TorchComm)."""

    alloc = staticmethod(torch.empty)

    def __init__(self, label: str):
        global _made
        threads, devices, interface = VARIANTS[label]
        opts = ProcessGroupGloo._Options()
        opts._threads = threads
        opts._timeout = datetime.timedelta(minutes=10)
        opts._devices = [_device(interface) for _ in range(devices)]
        _made += 1
        store = PrefixStore(f"bench-gloo-{_made}", dist.distributed_c10d._get_default_store())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pg = ProcessGroupGloo(store, self.rank, self.world, opts)

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def close(self) -> None:
        """Ends the group while Python is whole: its worker threads drop their last tensor
        references (which takes the GIL) before they are joined. Left to interpreter exit,
        a worker doing so was killed mid-unwind and aborted a finished job (exit 134)."""
        self.pg.barrier().wait()
        self.pg = None

    def unsupported(self, op: str, dtype: torch.dtype, redop: str) -> str:
        return ""

    def launcher(self, op: str, bufs: Buffers, redop: str) -> Callable[[], None]:
        pg, red = self.pg, REDOPS[redop]
        work, out = bufs.work, bufs.out

        def opts(kind, **fields):
            o = kind()
            for k, v in fields.items():
                setattr(o, k, v)
            return o

        calls = {
            "all_reduce": lambda: pg.allreduce([work], opts(AllreduceOptions, reduceOp=red)),
            "all_gather": lambda: pg._allgather_base(out, work),
            "reduce_scatter": lambda: pg._reduce_scatter_base(
                out, work, opts(ReduceScatterOptions, reduceOp=red)),
            "broadcast": lambda: pg.broadcast([work], opts(BroadcastOptions, rootRank=ROOT)),
            "reduce": lambda: pg.reduce([work], opts(ReduceOptions, reduceOp=red,
                                                     rootRank=ROOT)),
            "all_to_all": lambda: pg.alltoall_base(out, work, [], [], AllToAllOptions()),
        }
        start = calls[op]
        return lambda: start().wait()
