"""Cases run on the ranks by tests/test_zero_copy.py: collectives on arena tensors
(``pycomm.empty``) against float64 references, with the path each call took read from
pycomm's TRACE log.

Every case runs on groups made here once per rank process, with ``PYCOMM_DEBUG=TRACE``,
in one fixed order (every rank calls new_group alike): the whole world and, at 4 ranks,
the subgroups [0, 2] and [1, 2, 3]. The log lines of each call are read from fd 2 while
the case runs, so the path is checked per call: zero-copy when every member's buffer is
in the arena, the streamed fallback ("not every rank's buffer is in the arena") when
some are not, direct or local for small messages.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import pycomm

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool")
FLOATS = ("float32", "float64", "float16", "bfloat16")
# Messages at least this big are far above the direct size (4 KiB, 64 KiB when ranks
# outnumber cores), so they take zero-copy or its fallback.
ABOVE_DIRECT_BYTES = 1 << 17
SMALL_COUNTS = (0, 1, 7)  # direct (0 elements too): arena tensors must work there too
SECOND_BIG = ("float32", "bfloat16", "float16", "int8", "bool")  # also 3x the big count
SLAB_ELEMS = (64 << 20) // 4 + 1  # one float32 more than an arena slab
ZERO_COPY = "zero-copy (every rank's buffer is in the arena)"
FALLBACK = "(not every rank's buffer is in the arena)"
MISMATCH_TIMEOUT_S = 5.0
GROUP_TIMEOUT_S = 30.0

_GROUPS: dict[tuple[int, ...], object] = {}


def layouts(world: int) -> list[tuple[int, ...]]:
    """The groups every case runs on, by global ranks."""
    full = tuple(range(world))
    return [full, (0, 2), (1, 2, 3)] if world == 4 else [full]


def _groups() -> dict[tuple[int, ...], object]:
    """This rank's TRACE-logging groups, made on first use in one order on every rank."""
    if not _GROUPS:
        saved = os.environ.get("PYCOMM_DEBUG")
        os.environ["PYCOMM_DEBUG"] = "TRACE"
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)  # a hang fails, fast
        try:
            for ranks in layouts(dist.get_world_size()):
                _GROUPS[ranks] = dist.new_group(list(ranks), backend="pycomm", timeout=timeout)
        finally:
            if saved is None:
                del os.environ["PYCOMM_DEBUG"]
            else:
                os.environ["PYCOMM_DEBUG"] = saved
    return _GROUPS


class LogTap:
    """fd 2 (pycomm's log) into a file while open; ``take()`` is what came since."""

    def __enter__(self) -> LogTap:
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self._pos = 0
        return self

    def take(self) -> str:
        self._file.seek(self._pos)
        data = self._file.read()
        self._pos += len(data)
        return data.decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.close()


# --- inputs, references, checks -------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def big_count(dtype: str, per: int = 1) -> int:
    """An element count above the direct size, odd, so not divisible by any world size;
    ``per``: the message holds ``per`` such blocks (reduce_scatter, all_to_all)."""
    itemsize = torch.empty(0, dtype=_dtype(dtype)).element_size()
    return ABOVE_DIRECT_BYTES // itemsize // per + 3 | 1


def counts(dtype: str, per: int = 1) -> tuple[int, ...]:
    """Small counts, one odd count above the direct size, and for some dtypes (the
    most used, the 1- and 2-byte ones) a second, three times as big."""
    more = (3 * big_count(dtype, per) + 2,) if dtype in SECOND_BIG else ()
    return SMALL_COUNTS + (big_count(dtype, per), *more)


_GOLDEN = 0.6180339887498949


def data(key: str, rank: int, count: int, dtype: str, op: str = "SUM",
         start: int = 0) -> torch.Tensor:
    """Elements [start, start + count) of rank ``rank``'s input for ``key``: floats in
    [-1, 1] (not representable in 16 bits, so reductions round), small ints, bools.
    A Weyl sequence of the index (every element differs from its neighbours), not a
    random stream, so any slice is cheap to rebuild."""
    dt = _dtype(dtype)
    offset = (zlib.crc32(f"{key}/{rank}".encode()) % 1000003) / 1000003
    u = torch.arange(start, start + count, dtype=torch.float64).mul_(_GOLDEN).add_(offset)
    u.frac_()  # uniform-looking in [0, 1)
    if dt == torch.bool:
        return u < 0.5
    if dt.is_floating_point:
        return u.mul_(2).sub_(1).to(dt)
    high = 3 if op == "PRODUCT" else 20
    low = 0 if dt == torch.uint8 else -high
    return u.mul_(high - low + 1).floor_().add_(low).to(dt)


def reference(op: str, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float64 / int64 / bool reference, magnitude bound for rounding or None if exact)."""
    stacked = torch.stack(xs)
    if stacked.dtype == torch.bool:  # SUM/MAX = or, MIN/PRODUCT = and
        return (stacked.any(0) if op in ("SUM", "MAX") else stacked.all(0)), None
    wide = stacked.to(torch.float64 if stacked.is_floating_point() else torch.int64)
    if op in ("MIN", "MAX"):
        return (wide.amin(0) if op == "MIN" else wide.amax(0)), None
    if op == "PRODUCT":
        return wide.prod(0), wide.abs().prod(0).double()
    scale = 1.0 / len(xs) if op == "AVG" else 1.0
    return wide.sum(0) * scale if op == "AVG" else wide.sum(0), wide.abs().sum(0).double() * scale


def check(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor | None, n: int,
          what: str) -> str | None:
    """None if ``got`` matches the reference (exactly for ints, bools, MIN/MAX; within
    one rounding per rank for floats), else what is wrong."""
    if got.dtype == torch.bool or not got.dtype.is_floating_point or mag is None:
        want = want.to(got.dtype)  # integer wraparound happens here, as in the backend
        bad = got != want
        tol = torch.zeros(got.shape, dtype=torch.float64)
    else:
        if got.dtype == torch.float64:
            tol = 1e-12 * want.abs() + 1e-12 * n
        elif got.dtype == torch.float32:
            tol = 1e-5 * want.abs() + 1e-6 * n
        else:
            info = torch.finfo(got.dtype)
            want = want.to(got.dtype).double()
            tol = info.eps * n * mag + n * info.tiny * info.eps
        bad = ~((got.double() - want.double()).abs() <= tol)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {got.numel()} wrong; first at [{i}]: got "
            f"{got[i].item()} want {want[i].item()} (tol {tol[i].item():.3g})")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# --- who passes arena tensors, and which path that must take --------------------------


def arena_ranks(who: str, n: int) -> set[int]:
    """Group ranks whose buffers are in the arena: "all", "inputs" (every rank's inputs,
    no outputs), "even" (even group ranks), "last" (only the last one)."""
    if who in ("all", "inputs"):
        return set(range(n))
    if who == "even":
        return set(range(0, n, 2))
    return {n - 1}


def place(t: torch.Tensor, arena: bool) -> torch.Tensor:
    """``t``'s values in an arena tensor, or in an ordinary one."""
    if not arena:
        return t.clone()
    out = pycomm.empty(t.shape, dtype=t.dtype)
    assert out.numel() == 0 or pycomm.in_arena(out)
    return out.copy_(t)


def path_of(log: str) -> str:
    """The path one call took, from its TRACE line(s)."""
    lines = [line for line in log.splitlines()
             if re.search(r"\bseq \d+ ", line) and " done in " not in line]
    if not lines:
        return f"? (no log line: {log.strip()!r})"
    line = lines[-1]
    if ZERO_COPY in line:
        return "zero-copy"
    if FALLBACK in line:
        return "fallback"
    if m := re.search(r"pairwise, (\d+) of (\d+) peers read in place", line):
        return f"pulled {m.group(1)} of {m.group(2)}"
    for name in ("direct", "local", "pairwise", "ring", "chain"):
        if re.search(rf": {name}\b", line):
            return name
    return f"? ({line})"


def expected_path(bytes_: int, count: int, n: int, all_arena: bool) -> set[str]:
    if n == 1:
        return {"local"}
    if bytes_ <= 1024:  # far below any direct size; 0 elements still meet the others there
        return {"direct"}
    if bytes_ >= ABOVE_DIRECT_BYTES:
        return {"zero-copy"} if all_arena else {"fallback"}
    return {"direct", "zero-copy", "fallback"}  # between: not checked


# --- the cases ---------------------------------------------------------------------------


class CallFailed(Exception):
    """A collective raised (recorded in Case.bad); the group is failed, so the case stops."""


class Case:
    """One group, one arena pattern: runs calls, checks values and paths, collects
    failures and digests."""

    def __init__(self, ranks: tuple[int, ...], who: str, tap: LogTap):
        self.group = _groups()[ranks]
        self.ranks = ranks
        self.n = len(ranks)
        self.rank = dist.get_rank(self.group)
        self.who = who
        self.mine = self.rank in arena_ranks(who, self.n)
        self.all_arena = len(arena_ranks(who, self.n)) == self.n
        self.tap = tap
        self.bad: list[str] = []
        self.digests: list[str] = []

    def tag(self, what: str) -> str:
        return f"group {list(self.ranks)} arena={self.who} rank {self.rank}: {what}"

    def call(self, fn: Callable[[], object], what: str, expect: set[str]) -> None:
        self.tap.take()
        try:
            fn()
        except Exception as exc:
            self.bad.append(self.tag(f"{what} raised {type(exc).__name__}: {exc}"))
            raise CallFailed from exc
        path = path_of(self.tap.take())
        if path not in expect:
            self.bad.append(self.tag(f"{what} took {path}, expected {sorted(expect)}"))

    def verify(self, problem: str | None) -> None:
        if problem is not None:
            self.bad.append(self.tag(problem))


REDUCE_OPS = {  # op -> dtypes it is checked on (SUM: all)
    "SUM": DTYPES,
    "AVG": FLOATS,
    "MAX": ("float32", "bfloat16", "int8", "uint8", "int64", "bool"),
    "MIN": ("float64", "float16", "int32", "bool"),
    "PRODUCT": ("float32", "int8", "int32"),
}


def _op(name: str):
    return getattr(dist.ReduceOp, name)


def _all_reduce(c: Case, dtype: str, op: str) -> None:
    for count in counts(dtype):
        key = f"all_reduce/{dtype}/{op}/{count}"
        t = place(data(key, c.rank, count, dtype, op), c.mine)
        size = t.element_size() * count
        c.call(lambda t=t: dist.all_reduce(t, op=_op(op), group=c.group), key,
               expected_path(size, count, c.n, c.all_arena))
        if c.rank == 0:  # the others must hold the same bits: digests, in the parent
            want, mag = reference(op, [data(key, r, count, dtype, op) for r in range(c.n)])
            c.verify(check(t, want, mag, c.n, key))
        c.digests.append(digest(t))


def _all_reduce_beyond_a_slab(c: Case) -> None:
    """A float32 tensor one element bigger than an arena slab (its own slab)."""
    t = (pycomm.empty(SLAB_ELEMS) if c.mine else torch.empty(SLAB_ELEMS)).fill_(c.rank + 1)
    c.call(lambda: dist.all_reduce(t, group=c.group), "all_reduce beyond a slab",
           expected_path(4 * SLAB_ELEMS, SLAB_ELEMS, c.n, c.all_arena))
    if not bool((t == c.n * (c.n + 1) / 2).all()):
        c.bad.append(c.tag("all_reduce beyond a slab: wrong"))
    c.digests.append(digest(t))


def _reduce_scatter(c: Case, dtype: str, op: str) -> None:
    for count in counts(dtype, per=c.n):
        key = f"reduce_scatter/{dtype}/{op}/{count}"
        mine = data(key, c.rank, count * c.n, dtype, op)
        inp = place(mine, c.mine)
        out = place(torch.empty(count, dtype=_dtype(dtype)), c.mine and c.who != "inputs")
        size = inp.element_size() * count * c.n
        c.call(lambda inp=inp, out=out: dist.reduce_scatter_tensor(out, inp, op=_op(op),
                                                                   group=c.group),
               key, expected_path(size, count, c.n, c.all_arena))
        blocks = [data(key, r, count, dtype, op, start=c.rank * count) for r in range(c.n)]
        want, mag = reference(op, blocks)
        c.verify(check(out, want, mag, c.n, key))
        if not torch.equal(inp, mine):
            c.bad.append(c.tag(f"{key}: the input was modified"))


def _all_gather(c: Case, dtype: str, in_place: bool) -> None:
    for count in counts(dtype):
        key = f"all_gather/{dtype}/{count}/{'in place' if in_place else 'out of place'}"
        xs = [data(key, r, count, dtype) for r in range(c.n)]
        out_arena = c.mine and c.who != "inputs"
        if in_place and out_arena:  # FSDP's way: the input is this rank's part of out
            out = place(torch.zeros(count * c.n, dtype=_dtype(dtype)), True)
            inp = out[c.rank * count:(c.rank + 1) * count]
            inp.copy_(xs[c.rank])
        else:
            out = place(torch.zeros(count * c.n, dtype=_dtype(dtype)), out_arena)
            inp = place(xs[c.rank], c.mine)
        size = inp.element_size() * count
        c.call(lambda inp=inp, out=out: dist.all_gather_into_tensor(out, inp, group=c.group),
               key, expected_path(size, count, c.n, c.all_arena))
        if not torch.equal(out, torch.cat(xs)):
            c.bad.append(c.tag(f"{key}: data differs"))
        c.digests.append(digest(out))


def _broadcast(c: Case, dtype: str) -> None:
    for root in sorted({0, c.n - 1}):
        for count in counts(dtype):
            key = f"broadcast/{dtype}/root {root}/{count}"
            xs = [data(key, r, count, dtype) for r in range(c.n)]
            t = place(xs[c.rank], c.mine)
            src = c.ranks[root]
            c.call(lambda t=t, src=src: dist.broadcast(t, src=src, group=c.group), key,
                   expected_path(t.element_size() * count, count, c.n, c.all_arena))
            if not torch.equal(t, xs[root]):
                c.bad.append(c.tag(f"{key}: data differs"))
            c.digests.append(digest(t))


def _reduce(c: Case, dtype: str, op: str) -> None:
    for root in sorted({0, c.n - 1}):
        for count in counts(dtype):
            key = f"reduce/{dtype}/{op}/root {root}/{count}"
            xs = [data(key, r, count, dtype, op) for r in range(c.n)]
            t = place(xs[c.rank], c.mine)
            dst = c.ranks[root]
            c.call(lambda t=t, dst=dst: dist.reduce(t, dst=dst, op=_op(op), group=c.group),
                   key, expected_path(t.element_size() * count, count, c.n, c.all_arena))
            if c.rank == root:
                want, mag = reference(op, xs)
                c.verify(check(t, want, mag, c.n, key))
            elif not torch.equal(t, xs[c.rank]):  # zero-copy must not write non-roots
                c.bad.append(c.tag(f"{key}: a non-root's input was modified"))


def _pair_size(src: int, dst: int, base: int, uneven: bool) -> int:
    return base + ((3 * src + 5 * dst) % 7 if uneven else 0)


def _all_to_all(c: Case, dtype: str, uneven: bool) -> None:
    pulled = len(arena_ranks(c.who, c.n) - {c.rank})
    for base in counts(dtype, per=c.n):
        key = f"all_to_all/{dtype}/{base}/{'uneven' if uneven else 'even'}"
        sizes = [[_pair_size(s, d, base, uneven) for d in range(c.n)] for s in range(c.n)]
        xs = [data(key, s, sum(sizes[s]), dtype) for s in range(c.n)]
        recv = [sizes[s][c.rank] for s in range(c.n)]
        inp = place(xs[c.rank], c.mine)
        out = place(torch.empty(sum(recv), dtype=_dtype(dtype)), c.mine and c.who != "inputs")
        # Whether peers are read in place does not depend on the size (every rank
        # decides alike from the settings); check it where the blocks are big.
        big = base * inp.element_size() >= ABOVE_DIRECT_BYTES // c.n
        expect = ({f"pulled {pulled} of {c.n - 1}"} if big
                  else {"local", "pairwise"} | {f"pulled {k} of {c.n - 1}" for k in range(c.n)})
        c.call(lambda inp=inp, out=out, recv=recv, send=sizes[c.rank]: dist.all_to_all_single(
            out, inp, recv, send, group=c.group), key, expect)
        want = torch.cat([xs[s].split(sizes[s])[c.rank] for s in range(c.n)])
        if not torch.equal(out, want):
            c.bad.append(c.tag(f"{key}: data differs"))


def run_case(op_name: str, who: str) -> dict[str, list]:
    """Every dtype (and reduction) of one collective, on every group, with arena buffers
    as ``who`` says. Returns {"bad": [...], "digests": {group: [...]}} for this rank."""
    rank = dist.get_rank()
    bad: list[str] = []
    digests: dict[str, list[str]] = {}
    groups = _groups()
    torch.set_num_threads(1)  # several ranks per core: intra-op threads only contend
    with LogTap() as tap:
        for ranks in groups:
            if rank not in ranks:
                continue
            c = Case(ranks, who, tap)
            try:
                for dtype in DTYPES:
                    if op_name == "all_reduce":
                        for op in (o for o, dts in REDUCE_OPS.items() if dtype in dts):
                            _all_reduce(c, dtype, op)
                    elif op_name == "reduce_scatter":
                        for op in (o for o, dts in REDUCE_OPS.items() if dtype in dts):
                            _reduce_scatter(c, dtype, op)
                    elif op_name == "all_gather":
                        _all_gather(c, dtype, in_place=False)
                        _all_gather(c, dtype, in_place=True)
                    elif op_name == "broadcast":
                        _broadcast(c, dtype)
                    elif op_name == "reduce":
                        for op in ("SUM", "MAX"):
                            _reduce(c, dtype, op)
                    elif op_name == "all_to_all":
                        _all_to_all(c, dtype, uneven=False)
                        _all_to_all(c, dtype, uneven=True)
                    else:
                        raise ValueError(op_name)
                if op_name == "all_reduce":
                    _all_reduce_beyond_a_slab(c)
            except CallFailed:
                pass  # recorded by Case.call; a raising call fails the group: stop here
            except Exception as exc:  # a bug of the case itself
                c.bad.append(c.tag("the case raised: " + "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__))))
            bad += c.bad
            digests[str(list(ranks))] = c.digests
    return {"bad": bad, "digests": digests}


# --- mismatches: ranks disagree on count or dtype ----------------------------------------


MISMATCHES = {  # case -> (collective, what differs on the last member, both sides' patterns)
    "all_reduce-count": ("all_reduce", "count"),
    "all_reduce-dtype": ("all_reduce", "dtype"),
    "reduce_scatter-count": ("reduce_scatter", "count"),
    "all_gather-count": ("all_gather", "count"),
    "broadcast-dtype": ("broadcast", "dtype"),
    "reduce-count": ("reduce", "count"),
}


@contextlib.contextmanager
def _own_group(ranks: tuple[int, ...]) -> Iterator[object]:
    """A fresh group with a short timeout (a mismatch fails it), destroyed afterwards."""
    group = dist.new_group(list(ranks), backend="pycomm",
                           timeout=datetime.timedelta(seconds=MISMATCH_TIMEOUT_S))
    try:
        yield group
    finally:
        if dist.get_rank() in ranks:
            dist.destroy_process_group(group)


def mismatch(case: str, ranks: tuple[int, ...], who: str) -> dict | None:
    """The last member of ``ranks`` calls with one element more (or float64 instead of
    float32) than the others, arena buffers as ``who`` says. Every member must raise,
    naming both calls, within the timeout."""
    op_name, differs = MISMATCHES[case]
    rank = dist.get_rank()
    with _own_group(ranks) as group:
        if rank not in ranks:
            return None
        n, me = len(ranks), dist.get_rank(group)
        odd = me == n - 1
        count = big_count("float32") + (1 if odd and differs == "count" else 0)
        dtype = torch.float64 if odd and differs == "dtype" else torch.float32
        arena = me in arena_ranks(who, n)
        mk = pycomm.zeros if arena else torch.zeros

        def call():
            if op_name == "all_reduce":
                return dist.all_reduce(mk(count, dtype=dtype), group=group)
            if op_name == "reduce_scatter":
                return dist.reduce_scatter_tensor(mk(count, dtype=dtype),
                                                  mk(count * n, dtype=dtype), group=group)
            if op_name == "all_gather":
                return dist.all_gather_into_tensor(mk(count * n, dtype=dtype),
                                                   mk(count, dtype=dtype), group=group)
            if op_name == "broadcast":
                return dist.broadcast(mk(count, dtype=dtype), src=ranks[0], group=group)
            return dist.reduce(mk(count, dtype=dtype), dst=ranks[0], group=group)

        start = time.monotonic()
        try:
            call()
        except RuntimeError as exc:  # DistBackendError is one
            return {"elapsed": time.monotonic() - start, "type": type(exc).__name__,
                    "message": str(exc)}
        return {"elapsed": time.monotonic() - start, "type": "", "message": "no error"}
