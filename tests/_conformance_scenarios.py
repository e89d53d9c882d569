"""Rank-side cases for ``test_conformance``: the candidate backend against gloo, in one job.

Each rank's default group is the candidate (pycomm; gloo when the suite validates
itself). :func:`setup` adds a gloo group over the same ranks, the *reference*. A
case is a function of one :class:`Side`; :func:`run_case` runs it on the reference,
then on the candidate, with identical inputs (every input is rebuilt from the case
name and the rank), and returns both results for the parent to compare.

Results are plain data: tensors, numbers, strings, and lists/tuples/dicts of them.
Conventions the parent's comparison understands:

- ``{"n/a": why}`` (see :func:`na`) where a subtree does not apply: on the reference,
  the candidate's subtree there is not compared (gloo has no future for that op); at
  the top level of a result, the whole case is "not applicable" (torch itself
  refuses the call for that backend, and the case checked that it was torch).
- A dict key that starts with ``info:`` holds something that is reported when it
  differs but is not part of torch's contract (an exception's type, the structure
  of a future's value where torch's own backends disagree).

Inputs are integer-valued (float64 unless the case is about dtypes), so sums,
products and averages of them are exact and the comparison can be exact too; a
case that cannot be exact says so in its ``tol_why``.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import re
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Deprecated names (all_gather_into_tensor, reduce_scatter_tensor, all_gather_coalesced,
# the functional collectives) are what existing code calls, so they are tested.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, message=".*not part of the group.*")
warnings.filterwarnings("ignore", category=UserWarning, message=".*Running .* on global rank.*")

# Older torch (2.9, 2.10) has no all_gather_single / reduce_scatter_single: there the
# cases call the same collectives by their older names (as parallel/ does).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

PG_TIMEOUT_S = 10.0  # every group's timeout (the candidate's default group gets it from the pool)
CASE_TIMEOUT_S = 40.0  # a case's reference side may take this long before it counts as hung
# The candidate side counts as hung (faulthandler prints every thread's stack, the rank
# exits) after this long, or HANG_FACTOR times what the reference side took if longer.
HANG_MIN_S = 8.0
HANG_FACTOR = 5.0
SIZES = ((0,), (1,), (7,), (3, 5), (70_001,))  # 70_001 float64: past the 64 KiB direct path
LATE_S = 0.05  # how late the last rank starts where a case needs one rank to be late
PREMUL_FACTOR = 0.75  # x * 0.75 is exact for small integers, so the reference is exact

REFERENCE_ROLE, CANDIDATE_ROLE = "reference", "candidate"


def na(why: str) -> dict[str, str]:
    """Marks a result (or a subtree of one) as not applicable, saying why."""
    return {"n/a": why}


# ----------------------------------------------------------------------------- sides


@dataclass
class Side:
    """One backend's view of the job: its world group and how to make more groups."""

    role: str  # REFERENCE_ROLE or CANDIDATE_ROLE
    backend: str  # "gloo" or the candidate's backend name
    group: Any  # this side's group over every rank (a ProcessGroup)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    @property
    def is_reference(self) -> bool:
        return self.role == REFERENCE_ROLE

    @property
    def backend_arg(self) -> str | None:
        """``backend=`` for new groups: gloo for the reference, the default otherwise."""
        return "gloo" if self.is_reference else None

    def new_group(self, ranks: list[int]) -> Any:
        """A group over ``ranks`` with this side's backend, made once per rank process.

        Every rank runs the same cases in the same order, so every rank asks for the
        same groups in the same order, as new_group requires.
        """
        key = (self.role, "new_group", tuple(ranks))
        if key not in _CACHE:
            _CACHE[key] = dist.new_group(ranks, backend=self.backend_arg, timeout=_timeout())
        return _CACHE[key]

    def cached(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per rank process and side (groups, meshes)."""
        key = (self.role, name)
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


_CACHE: dict[tuple, Any] = {}


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=PG_TIMEOUT_S)


def setup(name: str) -> str:
    """Create the reference gloo group over every rank, and import what case ``name``
    needs; returns the candidate's backend.

    Imports happen here so that a case's time is its own (the candidate's hang limit
    scales with the reference's time): DDP's constructor imports torch._dynamo, two
    seconds, which only the cases that need it pay for.
    """
    for module in CASES[name].imports:
        importlib.import_module(module)
    _sides()
    return dist.get_backend()


def _sides() -> tuple[Side, Side]:
    if "sides" not in _CACHE:
        world = dist.group.WORLD
        ref = dist.new_group(backend="gloo", timeout=_timeout())
        _CACHE["sides"] = (Side(REFERENCE_ROLE, "gloo", ref),
                           Side(CANDIDATE_ROLE, dist.get_backend(), world))
    return _CACHE["sides"]


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """A conformance case; ``fn(side)`` returns what is compared between the sides."""

    fn: Callable[[Side], Any]
    function: str  # the torch.distributed function(s) it exercises (the report's row)
    tol: dict[str, float] | None = None  # rtol/atol for floating tensors; None: exact
    tol_why: str = ""
    # Each side's result is the same on every rank (a str: that key of the result is)
    replicated: bool | str = False
    timeout_s: float = CASE_TIMEOUT_S
    gloo_candidate_skip: str = ""  # why gloo cannot be the candidate (self-validation)
    exact_world2: bool = False  # with a tolerance: still exact at world size 2 (why in tol_why)
    imports: tuple[str, ...] = ()  # modules to import before the case (slow imports)


CASES: dict[str, Case] = {}


def case(name: str, function: str | None = None, **kwargs: Any) -> Callable:
    """Register ``fn`` as case ``name`` (decorator)."""

    def register(fn: Callable[[Side], Any]) -> Callable[[Side], Any]:
        assert name not in CASES, name
        CASES[name] = Case(fn, function or name.split("[")[0], **kwargs)
        return fn

    return register


def run_case(name: str) -> dict[str, Any]:
    """Run case ``name`` on the reference, then the candidate; both results by role.

    A side that raises fails the rank with the side named; a side that makes no
    progress is ended by faulthandler, which prints every thread's stack first.
    """
    spec = CASES[name]
    results: dict[str, Any] = {}
    ref_s = spec.timeout_s
    for side in _sides():
        limit = ref_s if side.is_reference else max(HANG_MIN_S, HANG_FACTOR * ref_s)
        print(f"case {name}: {side.role} ({side.backend}) starts; hung after {limit:.0f} s",
              flush=True)
        faulthandler.dump_traceback_later(limit, exit=True)
        start = time.monotonic()
        try:
            results[side.role] = spec.fn(side)
        except BaseException as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise SideError(f"{side.role} ({side.backend}) raised {type(exc).__name__}: "
                            f"{first}") from exc
        finally:
            faulthandler.cancel_dump_traceback_later()
        if side.is_reference:
            ref_s = time.monotonic() - start
    sys.stdout.flush()
    return results


class SideError(RuntimeError):
    """A side of a case raised; the message names the side and the first line."""


# --- inputs ----------------------------------------------------------------------------


def ints(tag: str, shape: tuple[int, ...], rank: int | None = None,
         dtype: torch.dtype = torch.float64, low: int = -3, high: int = 3) -> torch.Tensor:
    """Integer-valued data for ``tag`` on ``rank`` (this rank by default), any dtype."""
    rank = dist.get_rank() if rank is None else rank
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        real = torch.randint(low, high + 1, (*shape, 2), generator=gen).double()
        return torch.view_as_complex(real).to(dtype)
    if dtype == torch.uint8:
        low = 0
    return torch.randint(low, high + 1, shape, generator=gen).to(dtype)


def flat(value: Any) -> torch.Tensor:
    """A future's value (tensors in nested lists) as one flat tensor.

    torch's backends disagree on the value's structure (gloo returns the chunks of an
    all_gather_into_tensor output, NCCL the output itself), never on its data.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).clone()
    parts = [flat(v) for v in value]
    return torch.cat(parts) if parts else torch.empty(0)


def future_data(work: Any) -> torch.Tensor:
    """The data of ``work``'s future, waited for (the Work contract case checks that
    ``.value()`` alone would do after ``work.wait()``)."""
    return flat(work.get_future().wait())


def shape_of(value: Any) -> Any:
    """The structure of a future's value, for an ``info:`` entry."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [shape_of(v) for v in value]
    return type(value).__name__


def raised(call: Callable[[], Any]) -> dict[str, Any]:
    """Whether ``call()`` (and waiting on a Work it returns) raised; the type is info."""
    try:
        work = call()
        if work is not None and hasattr(work, "wait"):
            work.wait()
    except Exception as exc:
        return {"raised": True, "info:type": type(exc).__name__}
    return {"raised": False, "info:type": ""}


def _op(name: str) -> Any:
    return getattr(dist.ReduceOp, name)


# ============================================================================ collectives
# --- all_reduce ----------------------------------------------------------------------


def _all_reduce_case(op: str) -> Callable[[Side], Any]:
    dtype = torch.int64 if op in ("BAND", "BOR", "BXOR") else torch.float64

    def fn(side: Side) -> dict[str, torch.Tensor]:
        out = {}
        for shape in SIZES:
            t = ints(f"all_reduce/{op}/{shape}", shape, dtype=dtype)
            if op == "PREMUL_SUM" and side.is_reference:
                # gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo". The reference
                # pre-multiplies itself and sums on gloo (exact for these inputs).
                t.mul_(PREMUL_FACTOR)
                dist.all_reduce(t, group=side.group)
            elif op == "PREMUL_SUM":
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(PREMUL_FACTOR), group=side.group)
            else:
                dist.all_reduce(t, op=_op(op), group=side.group)
            out[str(shape)] = t
        return out

    return fn


for _name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
    case(f"all_reduce[{_name}]", replicated=True,
         gloo_candidate_skip="gloo has no PREMUL_SUM" if _name == "PREMUL_SUM" else "",
         )(_all_reduce_case(_name))

# ReduceOp.AVG of integer-valued float64 data: the only inexact reduction here.
AVG_TOL = {"rtol": 5e-16, "atol": 1e-15}
AVG_WHY = ("torch leaves AVG's rounding to the backend: gloo divides the exact sum by n "
           "(correctly rounded); multiplying by 1/n instead, as NCCL does for floats, "
           "is up to 1 ulp away when n is not a power of two")
case("all_reduce[AVG]", replicated=True, tol=AVG_TOL, tol_why=AVG_WHY)(_all_reduce_case("AVG"))

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex128)


@case("all_reduce[SUM, MAX: every dtype]", replicated=True)
def _all_reduce_dtypes(side: Side) -> dict[str, torch.Tensor]:
    out = {}
    for dtype in DTYPES:
        for op in ("SUM", "MAX"):
            if op == "MAX" and dtype.is_complex:
                continue  # complex numbers have no order (torch refuses)
            for shape in ((7,), (70_001,)):
                t = ints(f"all_reduce_dtypes/{dtype}/{op}/{shape}", shape, dtype=dtype)
                dist.all_reduce(t, op=_op(op), group=side.group)
                out[f"{dtype}/{op}/{shape}"] = t
    return out


@case("all_reduce[async: wait, future, then]", replicated=True)
def _all_reduce_async(side: Side) -> dict[str, Any]:
    g = side.group
    a, b, c = (ints(f"all_reduce_async/{k}", (5, 3)) for k in "abc")
    work = dist.all_reduce(a, group=g, async_op=True)
    waited = work.wait()
    fut = dist.all_reduce(b, group=g, async_op=True).get_future()
    value = fut.wait()
    chain = (dist.all_reduce(c, op=dist.ReduceOp.MAX, group=g, async_op=True).get_future()
             .then(lambda f: f.value()[0] * 2)
             .then(lambda f: f.value() + 1))
    return {"work.wait() returns": waited, "after work.wait()": a,
            "after future.wait()": b, "future.wait() value": flat(value),
            "info:future value structure": shape_of(value),
            "then(*2).then(+1)": chain.wait(), "tensor after chain": c}


@case("Future.then issuing a collective (PowerSGD pattern)", function="Future.then",
      replicated=True, timeout_s=10.0)
def _then_with_collective(side: Side) -> dict[str, torch.Tensor]:
    """A callback that issues another collective and waits for it, two levels deep:
    torch's PowerSGD hook does exactly this from DDP's comm hook future."""
    g = side.group
    x, y, z = (ints(f"then_collective/{k}", (6,)) for k in "xyz")
    if side.rank == side.size - 1:
        # late: elsewhere the callback is attached while the op runs, so it runs on
        # the thread that completes the op (attached to a done future, it would run
        # at once in the caller, and the case would prove nothing)
        time.sleep(LATE_S)

    def second(f: Any) -> torch.Tensor:
        got = dist.all_reduce(y, group=g, async_op=True).get_future().wait()
        return f.value()[0] + got[0]

    def third(f: Any) -> torch.Tensor:
        dist.all_reduce(z, op=dist.ReduceOp.MAX, group=g)  # a blocking one, too
        return f.value() * z

    out = dist.all_reduce(x, group=g, async_op=True).get_future().then(second).then(third)
    return {"chain value": out.wait(), "x": x, "y": y, "z": z}


@case("all_reduce_coalesced", replicated=True)
def _all_reduce_coalesced(side: Side) -> dict[str, Any]:
    g, out = side.group, {}
    shapes = ((3,), (2, 4), (0,), (70_001,))
    for op in ("SUM", "MAX"):
        ts = [ints(f"arc/{op}/{s}", s) for s in shapes]
        dist.all_reduce_coalesced(ts, op=_op(op), group=g)
        out[op] = ts
    ts = [ints(f"arc/async/{s}", s) for s in shapes]
    fut = dist.all_reduce_coalesced(ts, group=g, async_op=True)  # torch returns a Future here
    value = fut.wait()
    out["async"] = ts
    out["async future value"] = flat(value)
    return out


# --- broadcast / reduce ----------------------------------------------------------------


@case("broadcast", replicated=True)
def _broadcast(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        for shape in ((0,), (5, 3), (70_001,)):
            t = ints(f"broadcast/{root}/{shape}", shape)
            dist.broadcast(t, src=root, group=side.group)
            out[f"root {root} {shape}"] = t
        t = ints(f"broadcast/async/{root}", (9,))
        work = dist.broadcast(t, src=root, group=side.group, async_op=True)
        out[f"root {root} async wait"] = work.wait()
        out[f"root {root} async"] = t
        out[f"root {root} async future value"] = future_data(work)
    return out


@case("reduce")
def _reduce(side: Side, ops: tuple[str, ...] = ("SUM", "PRODUCT", "MAX")) -> dict[str, Any]:
    out = {}
    for op in ops:
        for root in range(side.size):
            t = ints(f"reduce/{op}/{root}", (4, 3))
            dist.reduce(t, dst=root, op=_op(op), group=side.group)
            # torch leaves non-root buffers unspecified after reduce: only the root's counts
            out[f"{op} root {root}"] = t if side.rank == root else None
    if ops == ("AVG",):
        return out
    t = ints("reduce/async", (70_001,))
    dist.reduce(t, dst=side.size - 1, group=side.group, async_op=True).wait()
    out["async"] = t if side.rank == side.size - 1 else None
    return out


# --- gathers ---------------------------------------------------------------------------


@case("all_gather", replicated=True)
def _all_gather(side: Side) -> dict[str, Any]:
    g, n, out = side.group, side.size, {}
    for shape in ((0,), (4, 3), (70_001,)):
        outs = [torch.full(shape, -99.0, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(outs, ints(f"all_gather/{shape}", shape), group=g)
        out[str(shape)] = outs
    outs = [torch.zeros(5, dtype=torch.float64) for _ in range(n)]
    work = dist.all_gather(outs, ints("all_gather/async", (5,)), group=g, async_op=True)
    out["async wait"] = work.wait()
    out["async"] = outs
    out["async future value"] = future_data(work)
    return out


@case("all_gather[uneven sizes]", function="all_gather", replicated=True,
      gloo_candidate_skip="gloo refuses all_gather of uneven sizes")
def _all_gather_uneven(side: Side) -> list[torch.Tensor]:
    """Rank r contributes r + 1 elements (torch: "correctly-sized tensors"; NCCL serves it).

    gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"): the reference is
    one gloo broadcast per rank, which is what NCCL does for uneven sizes.
    """
    mine = ints("all_gather_uneven", (side.rank + 1,))
    outs = [torch.zeros(r + 1, dtype=torch.float64) for r in range(side.size)]
    if side.is_reference:
        for root, t in enumerate(outs):
            if root == side.rank:
                t.copy_(mine)
            dist.broadcast(t, src=root, group=side.group)
    else:
        dist.all_gather(outs, mine, group=side.group)
    return outs


@case("all_gather_into_tensor", replicated=True)
def _all_gather_into_tensor(side: Side) -> dict[str, Any]:
    g, n, out = side.group, side.size, {}
    for shape in ((0,), (4, 3), (70_001,)):
        mine = ints(f"agit/{shape}", shape)
        cat = torch.full((n * shape[0], *shape[1:]), -99.0, dtype=torch.float64)
        dist.all_gather_into_tensor(cat, mine, group=g)
        stack = torch.full((n, *shape), -99.0, dtype=torch.float64)
        # gloo refuses a stacked output ("invalid tensor size at index 0 (expected (4, 3),
        # got (1, 4, 3))"): it gets the same memory viewed as a concatenated output
        dist.all_gather_into_tensor(stack.view(n * shape[0], *shape[1:])
                                    if side.backend == "gloo" else stack, mine, group=g)
        single = torch.full((n * shape[0], *shape[1:]), -99.0, dtype=torch.float64)
        _all_gather_single(single, mine, group=g)
        out[str(shape)] = {"concatenated": cat, "stacked": stack, "all_gather_single": single,
                           "input unchanged": torch.equal(mine, ints(f"agit/{shape}", shape))}
    mine, dst = ints("agit/async", (6,)), torch.zeros(6 * n, dtype=torch.float64)
    work = dist.all_gather_into_tensor(dst, mine, group=g, async_op=True)
    out["async wait"] = work.wait()
    out["async"] = dst
    value = work.get_future().wait()  # done: the Work contract case checks .value()
    out["async future value"] = flat(value)
    out["info:async future value structure"] = shape_of(value)
    return out


@case("all_gather_coalesced", replicated=True)
def _all_gather_coalesced(side: Side) -> dict[str, Any]:
    """torch's layout: ``output_tensor_lists[r][i]`` receives rank r's ``input_tensor_list[i]``."""
    g, n = side.group, side.size
    shapes = ((2, 2), (1,), (3,))
    inputs = [ints(f"agc/{i}", s) for i, s in enumerate(shapes)]
    outputs = [[torch.full(s, -99.0, dtype=torch.float64) for s in shapes] for _ in range(n)]
    dist.all_gather_coalesced(outputs, inputs, group=g)
    inputs2 = [ints(f"agc/async/{i}", s) for i, s in enumerate(shapes)]
    outputs2 = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(n)]
    fut = dist.all_gather_coalesced(outputs2, inputs2, group=g, async_op=True)  # a Future
    value = fut.wait()
    return {"sync": outputs, "async": outputs2, "async future value": flat(value)}


@case("gather")
def _gather(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        for shape in ((0,), (4, 3), (70_001,)):
            mine = ints(f"gather/{root}/{shape}", shape)
            lst = ([torch.full(shape, -99.0, dtype=torch.float64) for _ in range(side.size)]
                   if side.rank == root else None)
            dist.gather(mine, lst, dst=root, group=side.group)
            out[f"root {root} {shape}"] = lst
    lst = ([torch.zeros(3, dtype=torch.float64) for _ in range(side.size)] if side.rank == 0
           else None)
    dist.gather(ints("gather/async", (3,)), lst, dst=0, group=side.group, async_op=True).wait()
    out["async"] = lst
    return out


@case("scatter")
def _scatter(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        for shape in ((0,), (4, 3), (70_001,)):
            lst = ([ints(f"scatter/{root}/{shape}/{i}", shape) for i in range(side.size)]
                   if side.rank == root else None)
            t = torch.full(shape, -99.0, dtype=torch.float64)
            dist.scatter(t, lst, src=root, group=side.group)
            out[f"root {root} {shape}"] = t
    lst = ([ints(f"scatter/async/{i}", (3,)) for i in range(side.size)]
           if side.rank == 1 else None)
    t = torch.zeros(3, dtype=torch.float64)
    dist.scatter(t, lst, src=1, group=side.group, async_op=True).wait()
    out["async"] = t
    return out


# --- reduce_scatter ----------------------------------------------------------------------


@case("reduce_scatter")
def _reduce_scatter(side: Side, ops: tuple[str, ...] = ("SUM", "MAX", "PRODUCT")
                    ) -> dict[str, Any]:
    out = {}
    for op in ops:
        for shape in ((0,), (4, 3), (70_001,)):
            pieces = [ints(f"rs/{op}/{shape}/{i}", shape) for i in range(side.size)]
            t = torch.full(shape, -99.0, dtype=torch.float64)
            dist.reduce_scatter(t, pieces, op=_op(op), group=side.group)
            out[f"{op} {shape}"] = t
    if ops == ("AVG",):
        return out
    pieces = [ints(f"rs/async/{i}", (5,)) for i in range(side.size)]
    t = torch.zeros(5, dtype=torch.float64)
    out["async wait"] = dist.reduce_scatter(t, pieces, group=side.group, async_op=True).wait()
    out["async"] = t
    return out


@case("reduce_scatter_tensor")
def _reduce_scatter_tensor(side: Side, ops: tuple[str, ...] = ("SUM", "MAX", "PRODUCT")
                           ) -> dict[str, Any]:
    g, n, out = side.group, side.size, {}
    for op in ops:
        for shape in ((0,), (2, 3), (70_001,)):
            src = ints(f"rst/{op}/{shape}", (n * shape[0], *shape[1:]))
            t = torch.full(shape, -99.0, dtype=torch.float64)
            dist.reduce_scatter_tensor(t, src, op=_op(op), group=g)
            stacked = ints(f"rst/{op}/{shape}/stacked", (n, *shape))
            t2 = torch.full(shape, -99.0, dtype=torch.float64)
            # gloo has no stacked form ("Check failed: outputShape[0] * worldSize ==
            # inputShape[0]"): it gets the same memory viewed as the concatenated form
            dist.reduce_scatter_tensor(t2, stacked.view(n * shape[0], *shape[1:])
                                       if side.backend == "gloo" else stacked,
                                       op=_op(op), group=g)
            t3 = torch.full(shape, -99.0, dtype=torch.float64)
            _reduce_scatter_single(t3, src, op=_op(op), group=g)
            out[f"{op} {shape}"] = {"concatenated input": t, "stacked input": t2,
                                    "reduce_scatter_single": t3, "input": src}
    if ops == ("AVG",):
        return out
    src, t = ints("rst/async", (n * 4,)), torch.zeros(4, dtype=torch.float64)
    out["async wait"] = dist.reduce_scatter_tensor(t, src, group=g, async_op=True).wait()
    out["async"] = t
    return out


@case("reduce, reduce_scatter, reduce_scatter_tensor[AVG]", function="reduce/reduce_scatter",
      tol=AVG_TOL, tol_why=AVG_WHY)
def _avg_rooted(side: Side) -> dict[str, Any]:
    return {"reduce": _reduce(side, ("AVG",)), "reduce_scatter": _reduce_scatter(side, ("AVG",)),
            "reduce_scatter_tensor": _reduce_scatter_tensor(side, ("AVG",))}


# --- all_to_all ----------------------------------------------------------------------------


@case("all_to_all")
def _all_to_all(side: Side) -> dict[str, Any]:
    g, n, r, out = side.group, side.size, side.rank, {}
    ins = [ints(f"a2a/even/{i}", (3, 2)) for i in range(n)]
    outs = [torch.full((3, 2), -99.0, dtype=torch.float64) for _ in range(n)]
    dist.all_to_all(outs, ins, group=g)
    out["even"] = outs
    # Uneven: rank r sends (r + i) % 3 elements to rank i (some sends are empty).
    ins = [ints(f"a2a/uneven/{i}", ((r + i) % 3,)) for i in range(n)]
    outs = [torch.full(((j + r) % 3,), -99.0, dtype=torch.float64) for j in range(n)]
    if side.backend == "gloo":
        # gloo's list all_to_all refuses uneven sizes ("invalid tensor size"); torch's
        # contract allows them (NCCL serves them): gloo's all_to_all_single does the same
        whole = torch.zeros(sum(t.numel() for t in outs), dtype=torch.float64)
        dist.all_to_all_single(whole, torch.cat(ins), [t.numel() for t in outs],
                               [t.numel() for t in ins], group=g)
        for t, part in zip(outs, whole.split([t.numel() for t in outs]), strict=True):
            t.copy_(part)
    else:
        dist.all_to_all(outs, ins, group=g)
    out["uneven"] = outs
    ins = [ints(f"a2a/async/{i}", (2,)) for i in range(n)]
    outs = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
    out["async wait"] = dist.all_to_all(outs, ins, group=g, async_op=True).wait()
    out["async"] = outs
    return out


@case("all_to_all_single")
def _all_to_all_single(side: Side) -> dict[str, Any]:
    g, n, r, out = side.group, side.size, side.rank, {}
    for shape in ((n * 3,), (n * 2, 4), (n * 20_001,)):
        src = ints(f"a2as/even/{shape}", shape)
        dst = torch.full(shape, -99.0, dtype=torch.float64)
        dist.all_to_all_single(dst, src, group=g)
        out[f"even {shape}"] = dst
    # Uneven splits: rank r sends (r + i) % 3 rows to rank i, receives (j + r) % 3 from j.
    in_splits = [(r + i) % 3 for i in range(n)]
    out_splits = [(j + r) % 3 for j in range(n)]
    src = ints("a2as/uneven", (sum(in_splits), 2))
    dst = torch.full((sum(out_splits), 2), -99.0, dtype=torch.float64)
    dist.all_to_all_single(dst, src, out_splits, in_splits, group=g)
    out["uneven"] = dst
    src, dst = ints("a2as/async", (n * 2,)), torch.zeros(n * 2, dtype=torch.float64)
    work = dist.all_to_all_single(dst, src, group=g, async_op=True)
    out["async wait"] = work.wait()
    out["async"] = dst
    out["async future value"] = future_data(work)
    return out


# --- barriers ------------------------------------------------------------------------------


@case("barrier", replicated=True)
def _barrier(side: Side) -> dict[str, Any]:
    """Returns, and really waits: nobody leaves before the last rank (0.2 s late) arrived.

    Arrival and departure times are wall-clock times of one host, so comparable.
    """
    g, last = side.group, side.size - 1
    first = dist.barrier(group=g)
    arrived = torch.zeros(1, dtype=torch.float64)
    if side.rank == last:
        time.sleep(0.2)
        arrived.fill_(time.time())
    dist.barrier(group=g)
    left = time.time()
    dist.broadcast(arrived, src=last, group=g)
    waited = left >= arrived.item()
    work = dist.barrier(group=g, async_op=True)
    return {"returns": first, "blocked until the last rank arrived": waited,
            "async wait": work.wait(), "async future value": future_data(work)}


@case("monitored_barrier", replicated=True)
def _monitored_barrier(side: Side) -> Any:
    if side.backend != "gloo":
        try:
            dist.monitored_barrier(group=side.group, timeout=_timeout())
        except ValueError as exc:
            if "only implemented for GLOO" in str(exc):
                return na("torch: monitored_barrier is implemented for gloo only "
                          "(distributed_c10d refuses every other backend)")
            raise
        raise AssertionError("torch accepted monitored_barrier on a non-gloo group")
    returned = dist.monitored_barrier(group=side.group, timeout=_timeout())
    all_ranks = dist.monitored_barrier(group=side.group, timeout=_timeout(), wait_all_ranks=True)
    return {"returns": returned, "wait_all_ranks returns": all_ranks}


# --- Work / Future contract --------------------------------------------------------------


def _work_probe(make: Callable[[], Any], side: Side, value_here: bool = True
                ) -> dict[str, Any]:
    """What ``work.wait()`` guarantees about the Work and its future.

    A callback registered before the wait sleeps 50 ms before it records that it
    ran: gloo completes the future (running its callbacks inline) before it marks
    the Work done, so after ``wait()`` returns, the callback has finished. The last
    rank starts each op late, so that elsewhere the op is still running when the
    callback is attached (a callback attached to a done future runs at once, in the
    caller, and would prove nothing).
    """
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(LATE_S)
    work = make()
    try:
        fut = work.get_future()
    except RuntimeError as exc:
        if "not implemented" not in str(exc):
            raise
        fut = None  # gloo: "Work::getFuture not implemented" (p2p, reduce_scatter_tensor)
    ran: list[bool] = []

    def slow(f: Any) -> bool:
        time.sleep(0.05)
        ran.append(True)
        return True

    chained = fut.then(slow) if fut is not None else None
    waited = work.wait()
    # read everything at once, before anything else could let a late future complete
    done, callbacks_ran = fut is None or fut.done(), fut is None or bool(ran)
    completed = work.is_completed()
    result: dict[str, Any] = {
        "wait() returns": waited,
        "is_completed() after wait": completed,
        "future done after wait (or no future)": done,
        "then-callback finished before wait returned (or no future)": callbacks_ran,
    }
    if side.backend == "gloo" and not completed:
        # gloo's reduce_scatter_tensor Work says is_completed() False even after wait():
        # pycomm is held to torch's contract (True), not to that
        result["is_completed() after wait"] = True
        result["info:reference quirk"] = "gloo: is_completed() False after wait()"
    if fut is None:
        result["future"] = na("gloo has no future for this op")
    elif not value_here:  # reduce: torch leaves non-root buffers unspecified
        result["future"] = {"done": fut.wait() is not None}
    else:
        # .value() on a future that is not done raises an internal assert: wait() instead,
        # so an early Work shows up as the two flags above, not as an exception
        result["future"] = {"value": flat(fut.value() if done else fut.wait()),
                            "then-chain value": chained.wait()}
    return result


@case("Work: wait, is_completed, future after wait", function="Work / Future")
def _work_contract(side: Side) -> dict[str, Any]:
    g, n, r = side.group, side.size, side.rank
    f64 = torch.float64
    peer_next, peer_prev = (r + 1) % n, (r - 1) % n

    def p2p() -> Any:
        # even ranks send first; the odd receive first: no send waits on a send
        t = ints("work/p2p", (4,))
        if r % 2 == 0:
            return dist.isend(t, peer_next, group=g)
        return dist.irecv(torch.zeros(4, dtype=f64), peer_prev, group=g)

    makers: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(ints("work/ar", (8,)), group=g, async_op=True),
        "broadcast": lambda: dist.broadcast(ints("work/bc", (8,)), 0, group=g, async_op=True),
        "reduce": lambda: dist.reduce(ints("work/rd", (8,)), 0, group=g, async_op=True),
        "all_gather": lambda: dist.all_gather([torch.zeros(3, dtype=f64) for _ in range(n)],
                                              ints("work/ag", (3,)), group=g, async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.zeros(3 * n, dtype=f64), ints("work/agit", (3,)), group=g, async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=f64), ints("work/rst", (2 * n,)), group=g, async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.zeros(n, dtype=f64), ints("work/a2a", (n,)), group=g, async_op=True),
        "gather": lambda: dist.gather(
            ints("work/ga", (3,)), [torch.zeros(3, dtype=f64) for _ in range(n)] if r == 0
            else None, 0, group=g, async_op=True),
        "scatter": lambda: dist.scatter(
            torch.zeros(3, dtype=f64), [ints(f"work/sc/{i}", (3,)) for i in range(n)] if r == 0
            else None, 0, group=g, async_op=True),
        "barrier": lambda: dist.barrier(group=g, async_op=True),
        "isend / irecv": p2p,
    }
    out: dict[str, Any] = {}
    for name, make in makers.items():
        out[name] = _work_probe(make, side, value_here=name != "reduce" or r == 0)
        if name == "isend / irecv" and n % 2 == 1 and r == 0:  # odd: rank n-1 sent to 0 too
            dist.irecv(torch.zeros(4, dtype=f64), n - 1, group=g).wait()
    return out


@case("errors: bad arguments raise, group still usable", function="errors")
def _errors(side: Side) -> dict[str, Any]:
    """Calls that are wrong the same way on every rank raise on every rank, at the call
    or from wait(); the group then still works. Exception types are info (gloo raises
    RuntimeError for most, torch's own checks ValueError)."""
    g, n = side.group, side.size
    f64 = torch.float64
    checks: dict[str, Callable[[], Any]] = {
        "all_gather: n + 1 outputs": lambda: dist.all_gather(
            [torch.zeros(2, dtype=f64) for _ in range(n + 1)], torch.ones(2, dtype=f64), group=g),
        "all_gather: output of the wrong size": lambda: dist.all_gather(
            [torch.zeros(3, dtype=f64) for _ in range(n)], torch.ones(2, dtype=f64), group=g),
        "all_gather_into_tensor: wrong output size": lambda: dist.all_gather_into_tensor(
            torch.zeros(2 * n + 1, dtype=f64), torch.ones(2, dtype=f64), group=g),
        "reduce_scatter_tensor: wrong input size": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=f64), torch.ones(2 * n + 1, dtype=f64), group=g),
        "all_to_all_single: splits do not add up": lambda: dist.all_to_all_single(
            torch.zeros(n, dtype=f64), torch.ones(n, dtype=f64), [1] * n, [2] * n, group=g),
        "all_reduce: int16 (no backend supports it)": lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.int16), group=g),
        "all_reduce_coalesced: mixed dtypes": lambda: dist.all_reduce_coalesced(
            [torch.ones(2, dtype=f64), torch.ones(2, dtype=torch.float32)], group=g),
        "broadcast: src out of range": lambda: dist.broadcast(
            torch.ones(2, dtype=f64), src=n, group=g),
    }
    out: dict[str, Any] = {name: raised(call) for name, call in checks.items()}

    def boom(f: Any) -> None:
        raise ValueError("callback failed on purpose")

    fut = dist.all_reduce(ints("errors/then", (2,)), group=g, async_op=True).get_future()
    chained = fut.then(boom)
    try:
        chained.wait()
        out["then-callback error reaches wait()"] = False
    except Exception as exc:
        out["then-callback error reaches wait()"] = "callback failed on purpose" in str(exc)
    after = ints("errors/after", (5,))
    dist.all_reduce(after, group=g)
    out["all_reduce afterwards"] = after
    return out


# --- _coalescing_manager -----------------------------------------------------------------


@case("_coalescing_manager", replicated=True)
def _coalescing(side: Side) -> dict[str, Any]:
    g, n, out = side.group, side.size, {}
    for async_ops in (False, True):
        a, b = ints(f"cm/ar/{async_ops}/a", (3,)), ints(f"cm/ar/{async_ops}/b", (2, 2))
        with dist._coalescing_manager(group=g, async_ops=async_ops) as cm:
            dist.all_reduce(a, group=g)
            dist.all_reduce(b, group=g)
        if async_ops:
            cm.wait()
        ga, gb = torch.zeros(3 * n, dtype=torch.float64), torch.zeros(2 * n, dtype=torch.float64)
        with dist._coalescing_manager(group=g, async_ops=async_ops) as cm:
            dist.all_gather_into_tensor(ga, ints(f"cm/ag/{async_ops}/a", (3,)), group=g)
            dist.all_gather_into_tensor(gb, ints(f"cm/ag/{async_ops}/b", (2,)), group=g)
        if async_ops:
            cm.wait()
        ra, rb = torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        with dist._coalescing_manager(group=g, async_ops=async_ops) as cm:
            dist.reduce_scatter_tensor(ra, ints(f"cm/rs/{async_ops}/a", (3 * n,)), group=g)
            dist.reduce_scatter_tensor(rb, ints(f"cm/rs/{async_ops}/b", (2 * n,)), group=g)
        if async_ops:
            cm.wait()
        # reduce_scatter results differ per rank: gather them so the case stays replicated
        parts = [torch.zeros(5, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(parts, torch.cat([ra, rb]), group=g)
        out[f"async_ops={async_ops}"] = {"all_reduce": [a, b], "all_gather": [ga, gb],
                                         "reduce_scatter (all ranks)": parts}
    return out


# ==================================================================================== p2p


@case("send / recv", function="send/recv")
def _send_recv(side: Side) -> dict[str, Any]:
    """Every ordered pair in turn: a sends to b, b receives (the others wait their turn)."""
    g, n, r, out = side.group, side.size, side.rank, {}
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            for shape in ((5,), (70_001,)):
                if r == a:
                    dist.send(ints(f"sendrecv/{a}->{b}/{shape}", shape), b, group=g)
                elif r == b:
                    t = torch.full(shape, -99.0, dtype=torch.float64)
                    dist.recv(t, a, group=g)
                    out[f"{a}->{b} {shape}"] = t
    return out


@case("isend / irecv", function="isend/irecv")
def _isend_irecv(side: Side) -> dict[str, Any]:
    """Every rank posts a receive from and a send to every other rank, then waits all."""
    g, n, r = side.group, side.size, side.rank
    recvs = {src: torch.full((4, 2), -99.0, dtype=torch.float64) for src in range(n) if src != r}
    works = [dist.irecv(t, src, group=g, tag=src) for src, t in recvs.items()]
    works += [dist.isend(ints(f"isend/{r}->{dst}", (4, 2)), dst, group=g, tag=r)
              for dst in range(n) if dst != r]
    waited = [w.wait() for w in works]
    return {"received": {f"from {s}": t for s, t in recvs.items()}, "waits": waited,
            "is_completed": [w.is_completed() for w in works]}


@case("recv without src (any source)", function="recv/irecv (any source)")
def _recv_any(side: Side) -> dict[str, Any]:
    """Rank 0 receives from everyone without naming the source: recv returns the sender,
    irecv's Work tells it (``_source_rank``). Arrival order is free: sorted."""
    g, n, r = side.group, side.size, side.rank
    if r != 0:
        dist.send(torch.full((3,), float(r), dtype=torch.float64), 0, group=g)
        dist.send(torch.full((3,), float(10 + r), dtype=torch.float64), 0, group=g, tag=7)
        return {}
    got, got_i = [], []
    for _ in range(n - 1):
        t = torch.zeros(3, dtype=torch.float64)
        sender = dist.recv(t, group=g)
        got.append((sender, t[0].item(), bool((t == t[0]).all())))
    for _ in range(n - 1):
        t = torch.zeros(3, dtype=torch.float64)
        work = dist.irecv(t, group=g, tag=7)
        work.wait()
        got_i.append((work._source_rank(), t[0].item()))
    return {"recv: (returned sender, payload, whole)": sorted(got),
            "irecv tag 7: (source_rank, payload)": sorted(got_i)}


@case("tags: received in the opposite order", function="send/recv tags")
def _tags(side: Side) -> dict[str, Any]:
    """Each rank isends tag 1 then tag 2 to the next rank; the next rank receives tag 2
    first, then tag 1 (blocking recv), then the same with irecv posted in reverse."""
    g, n, r = side.group, side.size, side.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = {}
    for how in ("recv", "irecv"):
        sends = [dist.isend(ints(f"tags/{how}/{r}/{tag}", (6,)), nxt, group=g, tag=tag)
                 for tag in (1, 2)]
        two, one = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
        if how == "recv":
            dist.recv(two, prv, group=g, tag=2)
            dist.recv(one, prv, group=g, tag=1)
        else:
            works = [dist.irecv(two, prv, group=g, tag=2), dist.irecv(one, prv, group=g, tag=1)]
            for w in works:
                w.wait()
        for w in sends:
            w.wait()
        out[how] = {"tag 2": two, "tag 1": one}
    return out


@case("batch_isend_irecv", function="batch_isend_irecv")
def _batch(side: Side) -> dict[str, Any]:
    """A ring exchange both ways in one batch; at world 2 both peers are the same rank,
    so messages between one pair with one tag must match in posting order."""
    g, n, r = side.group, side.size, side.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    to_next, to_prev = ints("batch/next", (5,)), ints("batch/prev", (5,))
    from_prev = torch.full((5,), -99.0, dtype=torch.float64)
    from_next = torch.full((5,), -99.0, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, to_next, nxt, group=g),
           dist.P2POp(dist.irecv, from_prev, prv, group=g),
           dist.P2POp(dist.isend, to_prev, prv, group=g),
           dist.P2POp(dist.irecv, from_next, nxt, group=g)]
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    ring = torch.full((70_001,), -99.0, dtype=torch.float64)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.irecv, ring, prv, group=g),
        dist.P2POp(dist.isend, ints("batch/ring", (70_001,)), nxt, group=g)])
    for w in works:
        w.wait()
    return {"from prev": from_prev, "from next": from_next, "ring (large)": ring}


@case("isend / irecv to self", function="isend/irecv (self)",
      gloo_candidate_skip="gloo cannot send to itself")
def _self_p2p(side: Side) -> Any:
    """torch: "Unlike send, isend allows src == dst rank, i.e. send to self".

    gloo cannot ("Pair is not connected"): the reference is the tensor sent.
    """
    g, r = side.group, side.rank
    t = torch.zeros(4, dtype=torch.float64)
    if side.is_reference:
        return ints("self", (4,))
    recv = dist.irecv(t, r, group=g)
    send = dist.isend(ints("self", (4,)), r, group=g)
    send.wait()
    recv.wait()
    return t


# ================================================================================ objects


def _obj(tag: str, rank: int) -> dict[str, Any]:
    """A picklable object whose size depends on the rank (so gathers are uneven)."""
    return {"rank": rank, "tag": tag, "text": f"{tag}:" + "x" * (37 * rank + 1),
            "nested": [rank, (rank, str(rank)), {"k": rank * 1.5}],
            "tensor": ints(f"obj/{tag}", (rank + 1,), rank=rank)}


@case("all_gather_object", replicated=True)
def _all_gather_object(side: Side) -> list[Any]:
    out: list[Any] = [None] * side.size
    dist.all_gather_object(out, _obj("all_gather_object", side.rank), group=side.group)
    return out


@case("broadcast_object_list", replicated=True)
def _broadcast_object_list(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        objs = ([_obj(f"bol/{root}/{i}", root + i) for i in range(3)] if side.rank == root
                else [None] * 3)
        dist.broadcast_object_list(objs, src=root, group=side.group)
        out[f"root {root}"] = objs
    return out


@case("scatter_object_list")
def _scatter_object_list(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        inputs = ([_obj(f"sol/{root}", i) for i in range(side.size)] if side.rank == root
                  else None)
        got: list[Any] = [None]
        dist.scatter_object_list(got, inputs, src=root, group=side.group)
        out[f"root {root}"] = got
    return out


@case("gather_object")
def _gather_object(side: Side) -> dict[str, Any]:
    out = {}
    for root in range(side.size):
        lst = [None] * side.size if side.rank == root else None
        dist.gather_object(_obj(f"go/{root}", side.rank), lst, dst=root, group=side.group)
        out[f"root {root}"] = lst
    return out


@case("send_object_list / recv_object_list", function="send_object_list/recv_object_list")
def _send_recv_objects(side: Side) -> dict[str, Any]:
    g, n, r, out = side.group, side.size, side.rank, {}
    for a, b in ((0, n - 1), (n - 1, 0), (1, 0)):
        if r == a:
            dist.send_object_list([_obj(f"sol/{a}->{b}", a), "second"], dst=b, group=g)
        elif r == b:
            objs: list[Any] = [None, None]
            dist.recv_object_list(objs, src=a, group=g)
            out[f"{a}->{b}"] = objs
    return out


# ================================================================================= groups


@case("new_group: a subset that leaves ranks out", function="new_group")
def _new_group(side: Side) -> dict[str, Any]:
    """At world 2 the subset is rank 1 alone; above, ranks 0 and n-1 (the middle out)."""
    n, r = side.size, side.rank
    members = [1] if n == 2 else [0, n - 1]
    sub = side.new_group(members)
    everyone = side.new_group(list(range(n)))  # all ranks, yet a group apart from WORLD
    inside = r in members
    out: dict[str, Any] = {
        "group rank": dist.get_rank(sub), "group size": dist.get_world_size(sub),
        "ranks": dist.get_process_group_ranks(sub) if inside else None,
        "backend is this side's": not inside or dist.get_backend(sub) == side.backend,
    }
    t = ints("new_group/ar", (5,))
    ret = dist.all_reduce(t, group=sub)  # a non-member: torch returns at once, untouched
    out["all_reduce"], out["all_reduce returns"] = t, ret
    t = ints("new_group/bc", (5,))
    dist.broadcast(t, src=members[-1], group=sub)
    out["broadcast from its last member"] = t
    if inside:
        g_out = torch.zeros(len(members) * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(g_out, ints("new_group/ag", (3,)), group=sub)
        out["all_gather_into_tensor"] = g_out
        if len(members) == 2:  # p2p by group rank
            peer = 1 - dist.get_rank(sub)
            got = torch.zeros(3, dtype=torch.float64)
            reqs = [dist.isend(ints("new_group/p2p", (3,)), group=sub, group_dst=peer),
                    dist.irecv(got, group=sub, group_src=peer)]
            for w in reqs:
                w.wait()
            out["isend/irecv by group rank"] = got
    t = ints("new_group/everyone", (70_001,))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=everyone)
    out["all ranks, not WORLD"] = t
    t = ints("new_group/world", (5,))
    dist.all_reduce(t, group=side.group)
    out["world afterwards"] = t
    return out


@case("new_subgroups / new_subgroups_by_enumeration", function="new_subgroups")
def _new_subgroups(side: Side) -> dict[str, Any]:
    n, out = side.size, {}
    size = 2 if n % 2 == 0 else 1  # must divide the world size
    cur, subs = side.cached("new_subgroups", lambda: dist.new_subgroups(
        group_size=size, backend=side.backend_arg, timeout=_timeout()))
    enum = [[0, n - 1], list(range(1, n - 1))] if n > 2 else [[1], [0]]
    cur_e, _ = side.cached("by_enumeration", lambda: dist.new_subgroups_by_enumeration(
        enum, backend=side.backend_arg, timeout=_timeout()))
    for label, g in (("new_subgroups", cur), ("by_enumeration", cur_e)):
        t = ints(f"subgroups/{label}", (6,))
        dist.all_reduce(t, group=g)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size(g))]
        dist.all_gather(gathered, ints(f"subgroups/{label}/ag", (2,)), group=g)
        out[label] = {"ranks": dist.get_process_group_ranks(g), "rank": dist.get_rank(g),
                      "backend is this side's": dist.get_backend(g) == side.backend,
                      "all_reduce": t, "all_gather": gathered}
    out["number of subgroups"] = len(subs)
    return out


@case("split_group", replicated=True)
def _split_group(side: Side) -> Any:
    """torch 2.13 splits only groups bound to an accelerator device; on a CPU-only
    torch it refuses before reaching any backend. If a torch accepts, it is tested."""
    n = side.size
    try:
        sub = dist.split_group(parent_pg=side.group, split_ranks=[[0, n - 1]],
                               timeout=_timeout())
    except RuntimeError as exc:
        refusals = ("No device associated with the default pg",
                    "does not support splitting")
        if any(text in str(exc) for text in refusals):
            return na(f"torch refuses split_group here: {str(exc).splitlines()[0]}")
        raise
    t = ints("split", (4,))
    if sub is not None:
        dist.all_reduce(t, group=sub)
    return t


def _mesh(side: Side) -> Any:
    """(2, 2) at world 4, else (n,); the reference overrides every dimension to gloo."""
    from torch.distributed.device_mesh import init_device_mesh

    n = side.size
    shape, names = ((2, 2), ("dp", "tp")) if n == 4 else ((n,), ("dp",))
    override = {name: "gloo" for name in names} if side.is_reference else None
    return side.cached("mesh", lambda: init_device_mesh(
        "cpu", shape, mesh_dim_names=names, backend_override=override))


@case("DeviceMesh: collectives over each mesh dimension", function="init_device_mesh",
      imports=("torch.distributed.device_mesh", "torch.distributed.tensor"))
def _device_mesh(side: Side) -> dict[str, Any]:
    mesh, out = _mesh(side), {}
    out["coordinate"] = mesh.get_coordinate()
    for name in mesh.mesh_dim_names:
        g = mesh.get_group(name)
        t = ints(f"mesh/{name}", (2, 3))
        dist.all_reduce(t, group=g)
        gathered = torch.zeros(mesh.size(mesh.mesh_dim_names.index(name)) * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(gathered, ints(f"mesh/{name}/ag", (3,)), group=g)
        out[name] = {"local rank": mesh.get_local_rank(name),
                     "backend is this side's": dist.get_backend(g) == side.backend,
                     "ranks": dist.get_process_group_ranks(g), "all_reduce": t,
                     "all_gather_into_tensor": gathered}
    return out


@case("DTensor redistribute (functional collectives)", function="DTensor",
      imports=("torch.distributed.device_mesh", "torch.distributed.tensor"))
def _dtensor(side: Side) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh, out = _mesh(side), {}
    dim = mesh.mesh_dim_names[-1]
    sub = mesh[dim]
    k = sub.size()
    full = ints("dtensor/full", (4 * k, 6), rank=0)
    sharded = distribute_tensor(full, sub, [Shard(0)])  # scatter from rank 0
    out["Shard(0) local"] = sharded.to_local().clone()
    out["full_tensor (all_gather)"] = sharded.full_tensor()
    out["Shard(0) -> Shard(1) (all_to_all)"] = sharded.redistribute(sub, [Shard(1)]).to_local()
    partial = DTensor.from_local(ints("dtensor/partial", (3, 4)), sub, [Partial()])
    out["Partial -> Replicate (all_reduce)"] = partial.redistribute(sub, [Replicate()]).to_local()
    out["Partial -> Shard(0) (reduce_scatter)"] = partial.redistribute(sub, [Shard(0)]).to_local()
    return out


@case("functional collectives", function="_functional_collectives")
def _funcol(side: Side) -> dict[str, Any]:
    import torch.distributed._functional_collectives as funcol

    g, n, r = side.group, side.size, side.rank
    out = {
        "all_reduce sum": funcol.all_reduce(ints("funcol/ar", (5,)), "sum", g),
        "all_reduce max": funcol.all_reduce(ints("funcol/armax", (5,)), "max", g),
        "all_gather_tensor": funcol.all_gather_tensor(ints("funcol/ag", (2, 3)), 0, g),
        "reduce_scatter_tensor": funcol.reduce_scatter_tensor(
            ints("funcol/rs", (2 * n, 3)), "sum", 0, g),
        "broadcast": funcol.broadcast(ints("funcol/bc", (4,)), 1, g),
        "all_to_all_single": funcol.all_to_all_single(
            ints("funcol/a2a", (sum((r + i) % 3 for i in range(n)),)),
            [(j + r) % 3 for j in range(n)], [(r + i) % 3 for i in range(n)], g),
    }
    return {k: funcol.wait_tensor(v).clone() for k, v in out.items()}


@case("overlapping groups, async ops in flight on both", function="overlapping groups")
def _overlap(side: Side) -> dict[str, Any]:
    """World, ranks {0, 1} and ranks {1 .. n-1} with async ops on all of them at once:
    every rank issues its ops in one global order, then waits in the reverse order."""
    n, r = side.size, side.rank
    first = side.new_group([0, 1])
    rest = side.new_group(list(range(1, n))) if n > 2 else None
    f64 = torch.float64
    a, b, c, d = (ints(f"overlap/{k}", (70_001 if k == "a" else 9,)) for k in "abcd")
    gathered = torch.zeros(4 * n, dtype=f64)
    works = [dist.all_reduce(a, group=side.group, async_op=True)]
    if r in (0, 1):
        works.append(dist.all_reduce(b, group=first, async_op=True))
    works.append(dist.all_gather_into_tensor(gathered, ints("overlap/ag", (4,)),
                                             group=side.group, async_op=True))
    if rest is not None and r >= 1:
        works.append(dist.all_reduce(c, op=dist.ReduceOp.MAX, group=rest, async_op=True))
    if r in (0, 1):
        works.append(dist.broadcast(d, src=1, group=first, async_op=True))
    for w in reversed(works):
        w.wait()
    return {"world all_reduce": a, "{0,1} all_reduce": b, "world all_gather": gathered,
            "{1..n-1} all_reduce MAX": c, "{0,1} broadcast": d}


# ============================================================================ DDP hooks

DDP_STEPS = 6
DDP_IMPORTS = ("torch._dynamo", "torch.nn.parallel",
               "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
DDP_LR = 0.05


def _ddp_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # the same initial weights for both sides
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24),
                               torch.nn.ReLU(), torch.nn.Linear(24, 8))


def _bf16_compress(state, bucket):  # no annotations: DDP checks them against its own
    """torch's bf16_compress_hook, under another name: DDP.register_comm_hook refuses a
    hook *named* bf16_compress_hook unless torch has CUDA + NCCL 2.10 (or XPU), whatever
    the group's backend; the hook itself is plain torch and runs on any backend."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


@contextlib.contextmanager
def _batched_orthogonalize_fix() -> Iterator[None]:
    """Works around a torch 2.13 bug in batched_powerSGD_hook, for both sides alike.

    The hook calls ``_orthogonalize`` on one 2-D matrix, but ``_orthogonalize`` now
    takes a batch (3-D) and raises a bare AssertionError for anything else, so the
    hook fails on every backend once compression starts. The fix hands it the matrix
    as a batch of one (a view: the orthogonalisation stays in place), which is what the
    hook meant.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    original = psgd._orthogonalize

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    psgd._orthogonalize = orthogonalize
    try:
        yield
    finally:
        psgd._orthogonalize = original


def _ddp_train(side: Side, hook: str) -> dict[str, Any]:
    """SGD steps of a small MLP under DDP with one of torch's built-in comm hooks."""
    fix = _batched_orthogonalize_fix() if hook == "batched_powerSGD" else contextlib.nullcontext()
    with fix:
        return _ddp_steps(side, hook)


def _ddp_steps(side: Side, hook: str) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = _ddp_model()
    with torch.no_grad():  # replicas differ until DDP broadcasts rank 0's weights
        for p in net.parameters():
            p.add_(0.01 * side.rank)
    # ~1.5 KB buckets: several buckets, so the hook runs several times per step. Not for
    # PowerSGD: its callbacks block in wait() on the thread that completed the future, and
    # gloo (2 worker threads) deadlocks once two buckets' callbacks block at once; with one
    # bucket, gloo runs PowerSGD.
    powersgd = hook in ("powerSGD", "batched_powerSGD")
    ddp = DDP(net, process_group=side.group, bucket_cap_mb=None if powersgd else 0.0015)
    state: Any = side.group
    if hook in ("powerSGD", "batched_powerSGD"):
        # start_powerSGD_iter=2 (the smallest torch allows with error feedback): steps 0
        # and 1 all-reduce plainly, steps 2.. compress. min_compression_rate=0.5 makes
        # every matrix compress, however small.
        state = psgd.PowerSGDState(process_group=side.group, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5,
                                   random_seed=7)
    hook_fn = {"allreduce": default_hooks.allreduce_hook,
               "fp16_compress": default_hooks.fp16_compress_hook,
               "bf16_compress": _bf16_compress,
               "powerSGD": psgd.powerSGD_hook,
               "batched_powerSGD": psgd.batched_powerSGD_hook}[hook]
    ddp.register_comm_hook(state, hook_fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=DDP_LR)
    losses = []
    for step in range(DDP_STEPS):
        gen = torch.Generator().manual_seed(1000 * step + side.rank)
        x, y = torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if powersgd and side.rank == side.size - 1:
            # late, as some rank always is: elsewhere the hook's callbacks (which issue
            # collectives and wait) are attached while its all_reduce runs, so they run
            # on the thread that completes it, not at once in the caller
            time.sleep(LATE_S)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result: dict[str, Any] = {"params": [p.detach().clone() for p in net.parameters()],
                              "losses": torch.tensor(losses)}
    if hook in ("powerSGD", "batched_powerSGD"):
        result["compression ran (iter)"] = state.iter
    return result


# Tolerances (see each Case's tol_why). At world 2 every hook's reduction is one
# addition a + b, which is the same whichever rank adds: pycomm must then equal gloo
# bit for bit, compression included. From world 3 the order of additions is each
# backend's choice and rounds differently: float32 sums differ in the last bits, and
# fp16/bf16-compressed sums by one unit of the compressed format.
_DDP_TOLS = {
    "allreduce": ({"rtol": 1e-5, "atol": 1e-6},
                  "float32 sums of 3-4 addends in another order differ by ~1 ulp"),
    "fp16_compress": ({"rtol": 1e-3, "atol": 1e-4},
                      "fp16 sums of 3-4 addends in another order differ by 1 fp16 ulp (~5e-4 "
                      "relative) in a gradient; lr 0.05 over 6 steps keeps params within 1e-4"),
    "bf16_compress": ({"rtol": 1e-2, "atol": 1e-3},
                      "bf16 (8-bit mantissa) sums in another order differ by 1 bf16 ulp (~4e-3 "
                      "relative) in a gradient"),
    "powerSGD": ({"rtol": 1e-4, "atol": 1e-5},
                 "float32 sums in another order (~1 ulp), amplified by PowerSGD's "
                 "orthogonalisation and error feedback"),
    "batched_powerSGD": ({"rtol": 1e-4, "atol": 1e-5},
                         "as powerSGD: order of float32 sums, amplified by orthogonalisation"),
}

for _hook, (_tol, _why) in _DDP_TOLS.items():
    def _make(hook: str) -> Callable[[Side], Any]:
        return lambda side: _ddp_train(side, hook)

    _hook_path = ("powerSGD_hook." if "powerSGD" in _hook else "default_hooks.") + (
        f"{_hook}_hook")
    case(f"DDP + {_hook_path}", function="DDP comm hook", tol=_tol,
         tol_why=_why + "; exact at world 2 (a + b has one order)", exact_world2=True,
         replicated="params", timeout_s=60.0, imports=DDP_IMPORTS)(_make(_hook))


def describe_error(text: str) -> str:
    """A one-line summary of a RankFailure's text (for the report)."""
    side = re.search(r"(candidate|reference) \(\w+\) raised [^\n]*", text)
    if side:
        line = side.group(0)[:240]
        if "completed() INTERNAL ASSERT FAILED" in line:
            line += " (Future.value() on a future still incomplete after work.wait() returned)"
        return line
    if "Timeout (0:" in text:
        started = re.findall(r"case [^\n]*?: (\w+ \(\w+\)) starts; hung after (\d+) s", text)
        who, limit = started[-1] if started else ("a side", "?")
        dump = text[text.index("Timeout (0:"):]
        dump = dump[:dump.find("--- rank")] if "--- rank" in dump else dump
        # the innermost frame of each thread, as faulthandler printed them
        frames = re.findall(r"Thread 0x\w+ [^\n]*\n\s*(?:E\s+)?File \"[^\"]*?([^/\"]+)\", "
                            r"line (\d+) in (\w+)", dump)
        where = "; ".join(dict.fromkeys(f"{fn} ({f}:{line})" for f, line, fn in frames))
        return f"{who} hung: no progress in {limit} s; threads stuck in: {where}"[:300]
    first = [line for line in text.splitlines() if line.startswith("--- rank")]
    return (first[0][4:] if first else text.splitlines()[0])[:240]
