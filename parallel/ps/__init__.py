"""A parameter server (Li et al., OSDI 2014; ps-lite's design), as separate processes.

Servers hold ranges of a key space (consistent hashing, each range replicated on the
next R servers); workers push gradients and pull values asynchronously; the job chooses
sequential (BSP), bounded-delay (SSP) or eventual (async) consistency. Start a job with
``python -m pycomm.parallel.ps.launch --servers S --workers W -- python my_job.py``; in
``my_job.py``::

    from pycomm.parallel.ps import KVWorker
    kv = KVWorker()
    kv.declare("emb", dim=16, updater={"name": "adagrad", "lr": 0.1})
    ts = kv.pull(keys, table="emb"); rows = kv.result(ts)
    kv.wait(kv.push(keys, grads, table="emb")); kv.clock()
"""

from .worker import KVWorker, PSError

__all__ = ["KVWorker", "PSError"]
