"""What each rank runs in tests/test_cuda_collectives.py: every collective on CUDA
tensors against a float64 reference computed on the CPU, then a DDP step. All ranks use
``cuda:0`` (a single-GPU machine runs every rank on the one GPU, through CUDA IPC)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
COUNTS = (0, 1, 7, 4096, 1_000_003)  # odd, and large enough to use several chunks
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}


def _device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _input(rank: int, count: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + count)
    if dtype.startswith("int"):
        return torch.randint(-50, 50, (count,), generator=g, dtype=getattr(torch, dtype))
    return torch.randn(count, generator=g, dtype=torch.float64).to(getattr(torch, dtype))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> str:
    got64, want64 = got.cpu().double(), want.double()
    if dtype.startswith("int"):
        ok = torch.equal(got64, want64)
    else:
        tol = TOLERANCE[dtype] * max(1.0, float(want64.abs().max()) if want64.numel() else 1.0)
        ok = bool(torch.allclose(got64, want64, rtol=TOLERANCE[dtype], atol=tol))
    return "" if ok else f"{what}: max error {float((got64 - want64).abs().max())}"


def every_collective() -> list[str]:
    """Every collective x dtype x count; returns the failures (empty when all match)."""
    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in DTYPES:
        for count in COUNTS:
            ins = [_input(r, count, dtype) for r in range(n)]
            ref = torch.stack([x.double() for x in ins]).sum(0) if count else ins[0].double()
            t = ins[rank].to(dev)
            dist.all_reduce(t)
            failures.append(_close(t, ref, dtype, f"all_reduce SUM {dtype}[{count}]"))
            if not dtype.startswith("int"):
                t = ins[rank].to(dev)
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                failures.append(_close(t, ref / n, dtype, f"all_reduce AVG {dtype}[{count}]"))
            t = ins[rank].to(dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            want = torch.stack([x.double() for x in ins]).amax(0) if count else ref
            failures.append(_close(t, want, dtype, f"all_reduce MAX {dtype}[{count}]"))
            out = torch.empty(count * n, dtype=t.dtype, device=dev)
            dist.all_gather_into_tensor(out, ins[rank].to(dev))
            failures.append(_close(out, torch.cat([x.double() for x in ins]), dtype,
                                   f"all_gather {dtype}[{count}]"))
            big = [_input(r, count * n, dtype) for r in range(n)]
            shard = torch.empty(count, dtype=t.dtype, device=dev)
            dist.reduce_scatter_tensor(shard, big[rank].to(dev))
            total = torch.stack([x.double() for x in big]).sum(0)
            failures.append(_close(shard, total[rank * count:(rank + 1) * count], dtype,
                                   f"reduce_scatter {dtype}[{count}]"))
            root = n - 1
            t = ins[rank].to(dev)
            dist.broadcast(t, src=root)
            failures.append(_close(t, ins[root].double(), dtype, f"broadcast {dtype}[{count}]"))
    torch.cuda.synchronize()
    return [f for f in failures if f]


def fast_paths_take_the_cuda_path() -> list[str]:
    """pycomm.all_reduce_ and torch.ops.pycomm.all_reduce_ on CUDA tensors: the CUDA
    allreduce, never the shared-memory body (which would read device memory as host)."""
    import pycomm

    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in ("float32", "bfloat16"):
        ins = [_input(r, 1000, dtype) for r in range(n)]
        ref = torch.stack([x.double() for x in ins]).sum(0)
        t = ins[rank].to(dev)
        pycomm.all_reduce_(t)
        failures.append(_close(t, ref, dtype, f"pycomm.all_reduce_ {dtype}"))
        t = ins[rank].to(dev)
        torch.ops.pycomm.all_reduce_(t, "sum", dist.group.WORLD.group_name)
        failures.append(_close(t, ref, dtype, f"torch.ops.pycomm.all_reduce_ {dtype}"))
    torch.cuda.synchronize()
    return [f for f in failures if f]


def async_and_streams() -> list[str]:
    """async_op works, and ops on a side stream are ordered by wait()."""
    dev, n = _device(), dist.get_world_size()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.ones(1 << 20, device=dev)
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    value = float(t[0].item())
    return [] if value == n else [f"side-stream all_reduce gave {value}, expected {n}"]


def ddp_step_matches_single_process() -> float:
    """One DDP step on pycomm with CUDA tensors; the largest parameter difference from a
    single-process step on the concatenated batch."""
    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    model, reference = _mlp_and_reference(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    [(x, y)] = _batches(n, 1, dev)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    nn.functional.mse_loss(ddp(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
    opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                          reference.parameters(), strict=True))


def cupy_all_reduce() -> str:
    """A CuPy array all-reduced through torch.from_dlpack, without a copy."""
    import cupy  # type: ignore[import-not-found]

    _device()
    arr = cupy.full(1000, dist.get_rank() + 1, dtype=cupy.float32)
    t = torch.from_dlpack(arr)
    if t.data_ptr() != arr.data.ptr:
        return "torch.from_dlpack copied the CuPy array"
    dist.all_reduce(t)
    torch.cuda.synchronize()
    n = dist.get_world_size()
    want = n * (n + 1) / 2
    return "" if float(arr[0]) == want and float(arr[-1]) == want else f"got {arr[:3]}"


def _fresh_group(name: str, timeout_s: float = 60.0):
    """A pycomm backend of its own (own segment, own CUDA ring) over the default store."""
    import pycomm  # type: ignore[import-not-found]

    store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
    return pycomm._C.ProcessGroupPycomm(store, dist.get_rank(), dist.get_world_size(),
                                        timeout_s)


def op_after_shutdown_raises() -> str:
    """A CUDA op on a backend that was shut down raises instead of dereferencing null."""
    dev = _device()
    pg = _fresh_group("after-shutdown")
    t = torch.ones(4, device=dev)
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    pg.shutdown()
    try:
        pg.allreduce([t])
    except RuntimeError as exc:
        return "" if "was shut down" in str(exc) else f"unexpected error: {exc}"
    return "a CUDA all_reduce after shutdown did not raise"


def abort_reaches_peers_in_a_cuda_op() -> str:
    """Rank 0 aborts while the others wait in a CUDA all_reduce for its steps: they
    raise within seconds (the timeout is 60 s), naming rank 0."""
    import time

    dev, rank = _device(), dist.get_rank()
    pg = _fresh_group("abort-cuda")
    t = torch.ones(1 << 16, device=dev)
    pg.allreduce([t]).wait()  # the ring exists on every rank
    torch.cuda.synchronize()
    if rank == 0:
        time.sleep(1.0)
        pg.abort()
        return ""
    start = time.monotonic()
    try:
        pg.allreduce([t])
    except RuntimeError as exc:
        took = time.monotonic() - start
        ok = "rank 0 aborted the process group" in str(exc) and took < 15.0
        return "" if ok else f"after {took:.1f} s: {exc}"
    finally:
        pg.shutdown()
    return "the all_reduce did not raise after rank 0 aborted"


def list_forms_complete_after_copy_back() -> list[str]:
    """Ops on a side stream, waited for from the main stream: the list forms' copies back
    into the caller's tensors are covered by wait()."""
    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    count = 1 << 22
    side = torch.cuda.Stream()
    failures = []
    with torch.cuda.stream(side):
        outs = [torch.zeros(count, device=dev) for _ in range(n)]
        gather = dist.all_gather(outs, torch.full((count,), float(rank + 1), device=dev),
                                 async_op=True)
        parts = [torch.ones(count, device=dev) for _ in range(4)]
        coalesced = dist.all_reduce_coalesced(parts, async_op=True)
    gather.wait()
    coalesced.wait()
    got = [float(o.sum()) / count for o in outs]  # on the main stream, right after wait()
    if got != [float(r + 1) for r in range(n)]:
        failures.append(f"all_gather list after wait(): {got}")
    sums = [float(p.sum()) / count for p in parts]
    if sums != [float(n)] * 4:
        failures.append(f"all_reduce_coalesced after wait(): {sums}")
    return failures


def is_completed_follows_the_gpu() -> str:
    """is_completed() is False while the GPU has not run the op, True once it has."""
    dev = _device()
    t = torch.ones(1024, device=dev)
    torch.cuda._sleep(2_000_000_000)  # keeps this stream busy for about a second
    work = dist.all_reduce(t, async_op=True)
    early = work.is_completed()
    torch.cuda.synchronize()
    late = work.is_completed()
    return "" if (not early and late) else f"is_completed(): {early} while queued, {late} after"


def _mlp_and_reference(dev: torch.device) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)
    reference = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _batches(n: int, steps: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4 * n, 32, generator=g).to(dev), torch.randn(4 * n, 8, generator=g)
             .to(dev)) for _ in range(steps)]


def _reference_steps(reference: nn.Module, batches, opt_cls) -> None:
    opt = opt_cls(reference.parameters(), lr=0.01)
    for x, y in batches:
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()


def _largest_difference(params, reference: nn.Module) -> float:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(full, reference.parameters(), strict=True))


def fsdp2_steps_match_single_process() -> float:
    """Three Adam steps under FSDP2 (fully_shard per layer and at the root) on a CUDA mesh
    over pycomm: its all-gathers and reduce-scatters run on FSDP's own streams. The largest
    parameter difference from one process stepping on the concatenated batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    model, reference = _mlp_and_reference(dev)
    mesh = init_device_mesh(dev.type, (n,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = _batches(n, 3, dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches:
        rows = slice(4 * rank, 4 * rank + 4)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    _reference_steps(reference, batches, torch.optim.Adam)
    return _largest_difference(model.parameters(), reference)


def tensor_parallel_steps_match_single_process() -> float:
    """Three SGD steps of a column/row-parallel MLP (DTensor, parallelize_module) on a CUDA
    mesh over pycomm; every rank sees the whole batch. The largest parameter difference
    from the unsplit MLP in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dev, n = _device(), dist.get_world_size()
    model, reference = _mlp_and_reference(dev)
    mesh = init_device_mesh(dev.type, (n,))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    batches = _batches(n, 3, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    _reference_steps(reference, batches, torch.optim.SGD)
    return _largest_difference(model.parameters(), reference)


def rooted_and_coalesced_ops() -> list[str]:
    """reduce, gather, scatter and the coalesced tensor forms (FSDP2's) on CUDA tensors,
    float32 and bfloat16, odd sizes, every root; returns the failures."""
    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in ("float32", "bfloat16"):
        for count in (1, 7, 1_000_003):
            ins = [_input(r, count, dtype) for r in range(n)]
            total = torch.stack([x.double() for x in ins]).sum(0)
            for root in range(n):
                t = ins[rank].to(dev, copy=True)  # (a CPU run of this scenario aliases without)
                dist.reduce(t, dst=root)
                want = total if rank == root else ins[rank].double()  # others unchanged
                failures.append(_close(t, want, dtype, f"reduce {dtype}[{count}] root {root}"))
                outs = [torch.full((count,), -1.0, device=dev).to(t.dtype) for _ in range(n)]
                dist.gather(ins[rank].to(dev), outs if rank == root else None, dst=root)
                if rank == root:
                    failures.append(_close(torch.cat(outs), torch.cat([x.double() for x in ins]),
                                           dtype, f"gather {dtype}[{count}] root {root}"))
                blocks = [_input(100 + r, count, dtype) for r in range(n)]
                out = torch.full((count,), -1.0, device=dev).to(t.dtype)
                dist.scatter(out, [b.to(dev) for b in blocks] if rank == root else None, src=root)
                failures.append(_close(out, blocks[rank].double(), dtype,
                                       f"scatter {dtype}[{count}] root {root}"))
        sizes = (3, 1000, 17)
        parts = [[_input(10 * r + i, c, dtype) for i, c in enumerate(sizes)] for r in range(n)]
        outs = [torch.empty(c * n, device=dev).to(getattr(torch, dtype)) for c in sizes]
        group = dist.distributed_c10d._get_default_group()  # the coalesced ops FSDP2 calls
        group.allgather_into_tensor_coalesced(outs, [p.to(dev) for p in parts[rank]]).wait()
        for i, out in enumerate(outs):
            want = torch.cat([parts[r][i].double() for r in range(n)])
            failures.append(_close(out, want, dtype, f"all_gather coalesced {dtype} #{i}"))
        bigs = [[_input(20 * r + i, c * n, dtype) for i, c in enumerate(sizes)] for r in range(n)]
        shards = [torch.empty(c, device=dev).to(getattr(torch, dtype)) for c in sizes]
        group.reduce_scatter_tensor_coalesced(shards, [b.to(dev) for b in bigs[rank]]).wait()
        for i, (shard, c) in enumerate(zip(shards, sizes, strict=True)):
            want = torch.stack([bigs[r][i].double() for r in range(n)]).sum(0)
            failures.append(_close(shard, want[rank * c:(rank + 1) * c], dtype,
                                   f"reduce_scatter coalesced {dtype} #{i}"))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return [f for f in failures if f]
