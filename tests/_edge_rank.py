"""A rank for tests/test_backend_edges.py's cases that need a whole process, run as a
script: ``python _edge_rank.py RANK WORLD PORT MODE``.

MODE "stall": posts what every rank posts before the segment (its pid, its island key),
then never maps the segment: the window in which a rank can die, or rank 0 be sent
SIGTERM, after rank 0 has created the segment. "normal": a plain init. "exits": init,
a barrier, then the script ends without destroy_process_group. "outlives": init, a
barrier, then an all_reduce after the other rank has gone. "callback_at_exit": the
script ends while a future callback (Python) still runs on the group's worker. Prints
"init ok" or "init failed: <message>", and "op: <outcome>" for "outlives".
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import pycomm
from pycomm import _backend

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "stall":
    real = _backend._extension()

    class _NeverJoins:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def ProcessGroupPycomm(*_args):  # the extension class it stands in for
            print("in the window", flush=True)
            time.sleep(3600)

    _backend._extension = lambda: _NeverJoins()  # type: ignore[assignment]
# The test holds the store (pycomm.testing.held_store): every rank joins as a client.
store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
try:
    dist.init_process_group(pycomm.BACKEND_NAME, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    print("init ok", flush=True)
    if mode in ("exits", "outlives"):
        dist.barrier()
    if mode == "exits":
        sys.exit(0)  # the interpreter's exit drops the group: no destroy_process_group
    if mode == "callback_at_exit":  # the script ends while an op's Python callback runs
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.get_future().then(lambda fut: time.sleep(1.5))
        time.sleep(0.2)
        sys.exit(0)
    if mode == "outlives":
        time.sleep(1.0)
        try:
            dist.all_reduce(torch.ones(4))
            print("op: ok", flush=True)
        except Exception as exc:
            print(f"op: {exc}", flush=True)
    dist.destroy_process_group()
except Exception as exc:
    print(f"init failed: {exc}", flush=True)
