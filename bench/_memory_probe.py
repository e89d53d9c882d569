"""What a rank holds, measured from the outside: tensor storages reachable from an object,
the most bytes in use over a block of code, and the process's RSS and malloc.

None of it asks the optimizer (``memory_stats()`` is its own report): ``held_bytes``
walks the object graph and counts every tensor storage once, by role (a module's or an
optimizer's parameters, their ``.grad``, optimizer state, anything else: buckets,
gathered units, masters); :class:`PeakSampler` reads the process's bytes in use
(malloc's, whichever thread allocated, plus pycomm's shared-memory arena's) after every
aten op of a block; :class:`ProcessMeter` the kernel's peak RSS (``VmHWM``, reset
through ``/proc/self/clear_refs``) and the net change of malloc's and the arena's bytes.
(torch's profiler was not used: it records only the allocations and frees of the
threads it profiles, and pycomm's worker thread is not one.)
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROLES = ("params", "grads", "state", "other")  # a storage with several roles: the first
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_WALKED = ("pycomm", "torch", "bench", "tests")  # whose objects are walked (pycomm.parallel too)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (heap chunks + mmapped ones)."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def trim_malloc() -> None:
    """Give freed heap pages back to the kernel, so RSS is what is in use."""
    _libc.malloc_trim(0)


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssShmem and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def shm_live() -> int:
    """Bytes live in pycomm's shared-memory arena (0 without pycomm)."""
    try:
        import pycomm

        return int(pycomm.arena_stats()["live"])
    except Exception:  # no extension: nothing lives there
        return 0


class _Walk:
    """Every tensor storage reachable from the roots, with the roles it was reached in."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.storages: dict[int, tuple[int, set[str]]] = {}

    def tensor(self, t: torch.Tensor, role: str) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            nbytes, roles = self.storages.get(storage.data_ptr(), (0, set()))
            self.storages[storage.data_ptr()] = (max(nbytes, storage.nbytes()), roles | {role})
        grad = t.grad if t.is_leaf else None
        if grad is not None:
            self.tensor(grad, "grads")

    def visit(self, obj: Any, depth: int = 0) -> None:
        if torch.is_tensor(obj):
            self.tensor(obj, "other")
            return
        if depth > 14 or isinstance(obj, _SCALARS) or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                self.tensor(p, "params")
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizer(obj)
        for child in _children(obj):
            self.visit(child, depth + 1)

    def _optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self.tensor(p, "params")
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    self.tensor(value, "state")

    def by_role(self) -> dict[str, int]:
        out = dict.fromkeys(ROLES, 0)
        for nbytes, roles in self.storages.values():
            out[next(r for r in ROLES if r in roles)] += nbytes
        out["total"] = sum(out[r] for r in ROLES)
        return out


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    module = type(obj).__module__.split(".")[0]
    out: list[Any] = []
    if module in _WALKED:
        out.extend(getattr(obj, "__dict__", {}).values())
        slots = getattr(type(obj), "__slots__", ())
        out.extend(getattr(obj, s) for s in (slots if isinstance(slots, (list, tuple)) else ())
                   if hasattr(obj, s))
    return out


def held_bytes(*roots: Any) -> dict[str, int]:
    """Bytes of the unique tensor storages reachable from ``roots``, by role (see
    :data:`ROLES`), and their ``total``."""
    walk = _Walk()
    for root in roots:
        walk.visit(root)
    return walk.by_role()


def in_use() -> int:
    """Bytes this process has in use for data: malloc's (torch's CPU tensors among them,
    whichever thread allocated them) plus pycomm's shared-memory arena's."""
    return malloc_in_use() + shm_live()


class PeakSampler(TorchDispatchMode):
    """Around a block: the most bytes in use (:func:`in_use`) right after any aten op
    (every allocation is made by an op, so the peak is seen), and the level after.

    Example::

        with PeakSampler() as sampler:
            engine.train_step(x, y)
        sampler.peak, sampler.after    # bytes, process-wide
    """

    def __enter__(self) -> PeakSampler:
        gc.collect()
        self.start = self.peak = in_use()
        self.ops = 0
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        gc.collect()
        self.after = in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use())
        self.ops += 1
        return out


class ProcessMeter:
    """Around a block: the rise of peak RSS over RSS at the start (freed heap given
    back first, so the rise is pages newly touched), and the net change of malloc's
    bytes in use and of pycomm's shared-memory arena."""

    def __enter__(self) -> ProcessMeter:
        gc.collect()
        trim_malloc()
        self._malloc, self._shm = malloc_in_use(), shm_live()
        self._hwm_ok = reset_peak_rss()
        self._rss = proc_status()["VmRSS"]
        return self

    def __exit__(self, *exc: Any) -> None:
        status = proc_status()
        self.rss_peak_rise = status["VmHWM"] - self._rss if self._hwm_ok else -1
        gc.collect()
        self.malloc_net = malloc_in_use() - self._malloc
        self.shm_net = shm_live() - self._shm
