"""Shared memory per rank and small-message latency as the world grows.

For each world size, fresh ranks are spawned on this host; each joins one process group
per backend. The table shows what a group costs in ``/dev/shm`` (what Docker's
``--shm-size`` limits: the bytes the filesystem reports used after every rank created
its group, less before, divided by the ranks), and the latency of a small all_reduce
(back to back, as nccl-tests times: the median over ranks of the mean per call).
With more ranks than cores the ranks are oversubscribed: latency is then a measure
of how well waits yield, not of the transport.

Example::

    python -m bench.scaling --worlds 2,4,8,16,32 --backends pycomm,gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench._ports import hosted_store, init_default_group


def shm_used_bytes() -> int:
    """Bytes in use in /dev/shm, including unlinked segments that are still mapped."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _latency_us(group: dist.ProcessGroup, nbytes: int, iters: int) -> float:
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(max(5, iters // 10)):
        dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - start) / iters * 1e6


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    if "pycomm" in args.backends:
        import pycomm  # noqa: F401  (registers the backend)
    init_default_group("gloo", rank, world)
    rows = {}
    for backend in args.backends:
        dist.barrier()
        before = shm_used_bytes()
        dist.barrier()
        group = dist.new_group(backend=backend)
        dist.barrier()
        after = shm_used_bytes()
        latency = _latency_us(group, args.size, args.iters)
        # A message for the ring: its channels (one per rank) are reserved on first use.
        dist.all_reduce(torch.ones(args.ring_bytes // 4), group=group)
        dist.barrier()
        after_ring = shm_used_bytes()
        rows[backend] = {"shm_total": after - before, "shm_ring_total": after_ring - before,
                         "latency_us": latency}
        dist.barrier()
        dist.destroy_process_group(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        summary = {
            b: {
                "shm_per_rank": max(0, gathered[0][b]["shm_total"]) / world,
                "shm_per_rank_after_ring": max(0, gathered[0][b]["shm_ring_total"]) / world,
                "latency_us": statistics.median(r[b]["latency_us"] for r in gathered),
            }
            for b in args.backends
        }
        with open(out, "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict:
    """One fresh job of ``world`` ranks; {backend: {shm_per_rank, latency_us}}."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        with hosted_store(world):  # the ranks inherit its port (bench._ports)
            mp.spawn(_rank, args=(world, args, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8,16,32", help="world sizes (comma-separated)")
    p.add_argument("--backends", default="pycomm,gloo")
    p.add_argument("--size", type=int, default=1024, help="all_reduce message bytes")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--ring-bytes", type=int, default=4 << 20,
                   help="then one all_reduce this large (ring-sized), and memory again")
    p.add_argument("--json", help="write the table here too")
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worlds = [int(w) for w in args.worlds.split(",")]
    cores = len(os.sched_getaffinity(0))
    head = f"{'ranks':>5} " + " ".join(
        f"{b + ' MiB/rank':>18} {'+ring':>8} {b + ' us':>12}" for b in args.backends)
    print(f"# {cores} CPUs; all_reduce of {args.size} B, {args.iters} calls back to back; "
          f"+ring: MiB/rank after one {args.ring_bytes} B all_reduce too")
    print(head)
    table = {}
    for world in worlds:
        res = measure(world, args)
        table[world] = res
        cells = " ".join(f"{_mib(res[b]['shm_per_rank']):>18} "
                         f"{_mib(res[b]['shm_per_rank_after_ring']):>8} "
                         f"{res[b]['latency_us']:12.1f}" for b in args.backends)
        print(f"{world:>5} {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "size": args.size, "table": table}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
