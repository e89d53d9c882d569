"""What each rank of an offload run does (bench.offload, tests/test_offload_cap.py): a GPT
built on the meta device, trained by the composed engine at ZeRO-3 over every rank, with
or without offload; its step times, peak RSS and offload counters returned."""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import torch

# The memory-cap case of tests/test_offload_cap.py: a GPT of 114 blocks of width 256 whose
# replicated fp32 Adam state (1.34 GiB) is 3.06x a 448 MiB cap, on one rank, 5 steps.
# (The rank's own floor under the cap is ~200 MiB: pycomm's shared memory, 129 MiB, and
# torch's first ops; the peak varied by up to 70 MB between runs on a loaded machine, so
# the cap leaves ~90 MB above the highest peak seen.)
CI_CAP = 448 << 20
CI_CASE = dict(vocab=256, seq=16, n_layer=114, n_head=4, n_embd=256, batch=1, steps=5,
               ranks=1, prefetch=2)


def state_bytes(spec: dict[str, Any]) -> int:
    """16 bytes per parameter: the replicated fp32 weights, gradients and Adam moments."""
    return 16 * param_count(spec)


def param_count(spec: dict[str, Any]) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in _model(spec).parameters())


def _model(spec: dict[str, Any]) -> torch.nn.Module:
    from pycomm.parallel.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq"],
                         n_layer=spec["n_layer"], n_head=spec["n_head"],
                         n_embd=spec["n_embd"], dropout=0.0))


def train_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["steps"]`` steps; per step: wall time, and (offloaded) the seconds spent
    waiting for reads, in I/O threads and in unit steps."""
    import torch.distributed as dist

    from bench._memcap import join
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    torch.set_num_threads(spec.get("threads", 1))
    join()  # under a memory cap from here on: the model, its state, its buffers
    with torch.device("meta"):
        model = _model(spec)
    mesh = ParallelMesh(pp=1, dp=dist.get_world_size(), tp=1)
    engine = parallelize(model, mesh, ParallelConfig(
        zero=3, max_grad_norm=None, optimizer_kwargs={"lr": 1e-4}, offload=spec["offload"],
        offload_dir=spec.get("dir", ""), offload_prefetch=spec.get("prefetch", 2)))
    offload = engine.stage.__dict__["zero3"].offload
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(spec["steps"]):
        data = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=gen)
        before = dict(offload.io_stats()) if offload is not None else {}
        dist.barrier()
        start = time.perf_counter()
        loss = engine.train_step(data[:, :-1], data[:, 1:]).loss
        row = {"step_s": time.perf_counter() - start, "loss": loss}
        if offload is not None:  # this step's share of the counters
            after = offload.io_stats()
            for key in ("read_wait_s", "write_wait_s", "io_s", "bytes_read", "bytes_written"):
                row[key] = after[key] - before[key]
            row["unit_step_s"] = after["step_s"] - before["step_s"]
        steps.append(row)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"steps": steps, "peak_rss_mb": peak,
           "units": len(engine.stage.__dict__["zero3"].units)}
    if offload is not None:
        offload.flush()
        out["offload"] = offload.io_stats()
    mesh.destroy()
    return out


def _one_rank(fn: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import pycomm  # noqa: F401 (registers the backend)

    dist.init_process_group("pycomm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn(spec)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``python -m bench._offload_rank SPEC_JSON``: run ``spec["ranks"]`` ranks, print one
    JSON line of their results (the memory-cap harness runs this inside a cgroup)."""
    from bench._offload_rank import train_rank as by_name  # not __main__'s: ranks import it
    from pycomm.testing import run_ranks

    spec = json.loads(argv[0])
    if spec["ranks"] == 1:  # in this process: no launcher's memory beside the rank's
        results = [_one_rank(by_name, spec)]
        print(json.dumps({"spec": spec, "ranks": results}), flush=True)
        return
    results = run_ranks(by_name, spec["ranks"], spec, timeout_s=spec.get("timeout_s", 600))
    print(json.dumps({"spec": spec, "ranks": results}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
