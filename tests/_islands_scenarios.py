"""Cases run on the ranks of an islands group (PYCOMM_LOCAL_SIZE simulates the hosts).

The numerics reuse test_collectives' inputs, float64 references and checks, with its
element counts shortened so that every collective x dtype fits in one spawn per layout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import time
import warnings
from typing import Any

import test_collectives as tc
import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore", message=".*deprecated.*", category=FutureWarning)

COUNTS = (0, 1, 7, 1000, 30_001)  # 30_001: odd, so shards need padding
ALL_DTYPES = tc.FLOATS + tc.INTS


def _short_counts() -> None:
    tc.COUNTS = COUNTS  # the case functions read the module's counts


def backend() -> Any:
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def layout() -> tuple[str, list[list[int]], int, int]:
    b = backend()
    return type(b).__name__, b.islands, b.island, b.local_rank


# --- numerics: every collective x dtype --------------------------------------------


def all_reduce_everything() -> list[list[str]]:
    """Every dtype x op x count; digests come back so the parent compares ranks."""
    _short_counts()
    digests = []
    for dtype in ALL_DTYPES + ("bool",):
        for op in tc.OPS:
            if op in ("AVG", "PREMUL_SUM") and dtype not in tc.FLOATS:
                continue
            digests.append(tc._all_reduce_case(op, dtype, COUNTS))
    return digests


def reduce_scatter_everything(short: bool = False) -> None:
    """Both forms x SUM/AVG/MAX/PRODUCT; ``short``: three dtypes (the 6-rank layout)."""
    _short_counts()
    for dtype in tc.SHORT_DTYPES if short else ALL_DTYPES:
        for op in ("SUM", "AVG", "MAX", "PRODUCT"):
            if op == "AVG" and dtype not in tc.FLOATS:
                continue
            for form in ("tensor", "list"):
                tc._reduce_scatter_case(form, op, dtype)


def data_movement_everything() -> None:
    """all_gather (3 forms), broadcast and reduce from every root, gather/scatter,
    all_to_all (even and uneven), coalesced and async ops, non-contiguous tensors."""
    _short_counts()
    for dtype in ALL_DTYPES + ("bool",):
        for form in ("tensor", "tensor_async", "list"):
            tc._all_gather_case(form, dtype)
        tc._broadcast_case(dtype)
    for dtype in tc.SHORT_DTYPES:
        tc._reduce_case("SUM", dtype)
        tc._gather_scatter_case(dtype)
    for form in ("single_even", "single_uneven", "list_even", "list_uneven"):
        tc._all_to_all_case(form, "float32")
    tc._all_reduce_coalesced_case()
    tc._coalesced_all_gather_case()
    tc._async_case()
    for op in ("all_reduce", "broadcast"):
        for lay in ("transposed", "strided"):
            tc._non_contiguous_case(op, lay)


def send_recv_everything() -> None:
    for mode in ("blocking", "async", "batch"):
        tc._ring_case(mode)


def barrier_waits() -> tuple[float, float]:
    return tc._barrier_case()


# --- DDP on islands against DDP on gloo --------------------------------------------


def _train(group: Any, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_matches_gloo() -> float:
    """Largest parameter difference after a few steps: islands (default group) vs gloo."""
    gloo = dist.new_group(backend="gloo")
    ours, theirs = _train(dist.group.WORLD), _train(gloo)
    dist.destroy_process_group(gloo)
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


# --- traffic --------------------------------------------------------------------------


def _written() -> int:
    """Bytes this process has written to files and sockets (gloo sends with writev)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def traffic(numel: int, reps: int = 3) -> dict[str, float]:
    """Per all_reduce of ``numel`` float32: the counter, and bytes written to sockets
    by islands and by a flat gloo group (the same run, the same tensor)."""
    b = backend()
    gloo = dist.new_group(backend="gloo")
    t = torch.ones(numel)
    out: dict[str, float] = {}
    for name, group in (("islands", None), ("gloo", gloo)):
        dist.all_reduce(t, group=group)  # warm: connections and buffers exist
        dist.barrier()
        b.reset_inter_island_bytes()
        before = _written()
        for _ in range(reps):
            dist.all_reduce(t, group=group)
        out[f"{name}_written"] = (_written() - before) / reps
        if name == "islands":
            out["counter"] = b.inter_island_bytes / reps
        dist.barrier()
    dist.destroy_process_group(gloo)
    return out


# --- PYCOMM_DEBUG=TRACE ---------------------------------------------------------------


@contextlib.contextmanager
def _stderr_to(path: str):
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def debug_log() -> str:
    """What PYCOMM_DEBUG=TRACE prints for a new islands group and a few ops on it."""
    os.environ["PYCOMM_DEBUG"] = "TRACE"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stderr")
        with _stderr_to(path):
            group = dist.new_group(backend="pycomm")
            dist.all_reduce(torch.ones(1000), group=group)
            dist.broadcast(torch.ones(10), src=0, group=group)
            dist.destroy_process_group(group)
        os.environ.pop("PYCOMM_DEBUG")
        with open(path) as f:
            return f.read()


# --- failures ---------------------------------------------------------------------------


def bad_input() -> list[str]:
    """Messages for input the islands backend must refuse (in the caller, at once)."""
    n = dist.get_world_size()
    calls = [
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG),
        lambda: dist.reduce(torch.ones(4, dtype=torch.complex64), dst=0),
        lambda: dist.all_gather_into_tensor(torch.empty(n * 4 + 1), torch.ones(4)),
        lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(n * 4)),
        lambda: backend().allreduce([torch.empty(4, device="meta")]),
    ]
    messages = []
    for call in calls:
        try:
            call()
            messages.append("")
        except (ValueError, RuntimeError) as exc:
            messages.append(str(exc))
    return messages


def killed_rank(victim: int, timeout_s: float) -> str | None:
    """The victim dies after one good all_reduce; every other rank must raise, naming it."""
    t = torch.ones(1000)
    dist.all_reduce(t)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as exc:
        elapsed, message = time.monotonic() - start, str(exc)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: all_reduce succeeded without rank {victim}")
    assert elapsed < timeout_s + 5.0, f"rank {dist.get_rank()}: took {elapsed:.1f} s to fail"
    assert re.search(rf"rank\(s\) {victim}\b", message), message
    start = time.monotonic()
    try:  # the group stays failed, and says so at once
        dist.barrier()
    except dist.DistBackendError as exc:
        # at once, not after the group timeout (half of it: a loaded machine's margin)
        assert time.monotonic() - start < timeout_s / 2 and "first error" in str(exc), str(exc)
    else:
        raise AssertionError("a barrier succeeded after the group failed")
    return message

