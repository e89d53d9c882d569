"""CUDA numbers for bench/gpu_check.sh: pycomm's collectives on CUDA tensors (ranks on
one GPU through CUDA IPC, or one GPU each), NCCL through torch where it can run, the
copy-reduce kernel against the device's copy bandwidth, all measured in one run.

    python -m bench.gpu_collectives [--nproc 2] [--sizes-mb 1,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.distributed as dist

from pycomm.testing import RankFailure, run_ranks

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _time_ms(fn: Any, iters: int, warmup: int = 3) -> float:
    """Median per-call time from CUDA events, `iters` calls per sample, 5 samples."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _op_call(op: str, full: torch.Tensor, shard: torch.Tensor) -> Any:
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    return lambda: dist.reduce_scatter_tensor(shard, full)


def _collectives(sizes: list[int], one_gpu: bool) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0 if one_gpu else rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    rows = {}
    for op in OPS:
        for size in sizes:
            elems = size // 4
            x = torch.ones(elems // n * n, device=device)
            shard = torch.empty(elems // n, device=device)
            call = _op_call(op, x, shard)
            ms = _time_ms(call, iters=5 if size >= 64 << 20 else 20)
            algbw = size / (ms / 1e3) / 1e9
            rows[f"{op}/{size}"] = {"ms": ms, "algbw": algbw, "busbw": algbw * _bus_factor(op, n)}
    return rows


def _kernel_vs_copy(size: int) -> dict:
    """The copy-reduce kernel (2 sources) against torch's device copy of the same bytes;
    bandwidth counts bytes read + written by each."""
    from pycomm import _C  # type: ignore[attr-defined]

    n = size // 4
    a, b, out = (torch.randn(n, device="cuda") for _ in range(3))
    copy_ms = _time_ms(lambda: out.copy_(a), iters=10)
    reduce_ms = _time_ms(lambda: _C._cuda_copy_reduce(out, [a, b]), iters=10)
    torch.testing.assert_close(out, a + b)
    copy_gbs = 2 * size / (copy_ms / 1e3) / 1e9
    reduce_gbs = 3 * size / (reduce_ms / 1e3) / 1e9
    return {"size": size, "copy_GBps": copy_gbs, "reduce_GBps": reduce_gbs,
            "ratio": reduce_gbs / copy_gbs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes-mb", default="1,16,64,256")
    p.add_argument("--json", default="gpu_collectives.json")
    args = p.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    one_gpu = torch.cuda.device_count() < args.nproc
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "nproc": args.nproc,
                              "one_gpu": one_gpu}
    result["kernel"] = [_kernel_vs_copy(s) for s in (64 << 20, 256 << 20)]
    result["pycomm"] = run_ranks(_collectives, args.nproc, sizes, one_gpu, timeout_s=600)[0]
    try:
        result["nccl"] = run_ranks(_collectives, args.nproc, sizes, one_gpu, backend="nccl",
                                   timeout_s=300)[0]
    except RankFailure as exc:  # NCCL refuses two ranks on one GPU
        # the first line only counts the failed ranks; the next says why
        result["nccl"] = {"error": " ".join(str(exc).splitlines()[:3])[:300]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n# {result['device']}, {args.nproc} ranks{' on one GPU' if one_gpu else ''}")
    print("# copy-reduce kernel (2 sources) vs device copy, GB/s read+written")
    for k in result["kernel"]:
        print(f"  {k['size'] >> 20:5d} MB  copy {k['copy_GBps']:8.1f}  reduce "
              f"{k['reduce_GBps']:8.1f}  ratio {k['ratio']:.2f}")
    print("# op            MB   pycomm busbw GB/s   nccl busbw GB/s   ratio")
    for op in OPS:
        for size in sizes:
            key = f"{op}/{size}"
            ours = result["pycomm"][key]["busbw"]
            theirs = result["nccl"].get(key, {}).get("busbw")
            ratio = f"{ours / theirs:.2f}" if theirs else "-"
            nccl = f"{theirs:8.1f}" if theirs else "     n/a"
            print(f"  {op:14s} {size >> 20:4d}   {ours:8.1f}            {nccl}      {ratio}")
    if "error" in result["nccl"]:
        print(f"# nccl: {result['nccl']['error']}")


if __name__ == "__main__":
    main()
