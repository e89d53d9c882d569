"""Cases run on the ranks by tests/test_custom_op.py: ``torch.ops.pycomm.all_reduce_``
(and ``pycomm.all_reduce_``) against float64 references, on pycomm and gloo groups, in
eager mode and inside torch.compile graphs, ordered with async ops in flight."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pycomm

OPS = {"sum": torch.sum, "max": torch.amax, "min": torch.amin, "prod": torch.prod}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32)


def _inputs(count: int, dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    """Every rank's input, values exact in every dtype (small integers / 8)."""
    out = []
    for r in range(world):
        k = torch.randint(-3, 4, (count,), generator=torch.Generator().manual_seed(97 * r + count))
        out.append(k.to(dtype) if not dtype.is_floating_point else (k.double() / 8).to(dtype))
    return out


def every_op_dtype_and_size(group_backend: str) -> list[str]:
    """Each (op, dtype, size) on a group of ``group_backend``; the problems found."""
    group = dist.new_group(backend=group_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for op, ref_fn in OPS.items():
        for dtype in DTYPES:
            for count in (0, 1, 5, 1000, 70_000):
                inputs = _inputs(count, dtype, world)
                x = inputs[rank].clone()
                torch.ops.pycomm.all_reduce_(x, op, group.group_name)
                want = ref_fn(torch.stack([i.double() for i in inputs]), dim=0)
                if count and not torch.equal(x.double(), want.to(dtype).double()):
                    bad.append(f"{group_backend} {op} {dtype} {count}: rank {rank} differs")
    x = torch.ones(4, 3)[:, 1]  # not contiguous: staged through a copy
    pycomm.all_reduce_(x, group=group)
    if x.tolist() != [float(world)] * 4:
        bad.append(f"{group_backend}: non-contiguous view got {x.tolist()}")
    dist.destroy_process_group(group)
    return bad


def eager_path_matches_the_operator(group_backend: str) -> list[str]:
    """``pycomm.all_reduce_`` in eager mode (the backend's native entry on a pycomm group,
    the operator on any other) against float64, on a fresh group each time; then the
    group destroyed and another made: the new group's backend is the one called."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for round_ in range(2):
        group = dist.new_group(backend=group_backend)
        for op, ref_fn in OPS.items():
            for dtype in (torch.float32, torch.bfloat16, torch.int32):
                for count in (1, 1000, 70_000):
                    inputs = _inputs(count, dtype, world)
                    x = inputs[rank].clone()
                    assert pycomm.all_reduce_(x, op, group=group) is x
                    want = ref_fn(torch.stack([i.double() for i in inputs]), dim=0)
                    if not torch.equal(x.double(), want.to(dtype).double()):
                        bad.append(f"{group_backend} round {round_} {op} {dtype} {count}: "
                                   f"rank {rank} differs")
        dist.destroy_process_group(group)
        try:
            pycomm.all_reduce_(torch.ones(2), group=group)
            bad.append(f"{group_backend}: a destroyed group still reduced")
        except Exception:  # any clear refusal; its text is the backend's
            pass
    return bad


def ordered_after_async_ops() -> list[float]:
    """Async all_reduces in flight, then the direct op on the same group: it must run
    after them (same order on every rank), so it sees their results."""
    a = torch.ones(1 << 16)
    works = [dist.all_reduce(a, async_op=True) for _ in range(3)]
    c = torch.ones(8)
    torch.ops.pycomm.all_reduce_(c, "sum", dist.group.WORLD.group_name)
    for w in works:
        w.wait()
    return [a[0].item(), c[0].item()]


def compiled_graph() -> list[float]:
    """The op inside a torch.compile graph with fullgraph=True (no graph break)."""
    name = dist.group.WORLD.group_name

    def step(t: torch.Tensor) -> torch.Tensor:
        y = t * 2
        torch.ops.pycomm.all_reduce_(y, "sum", name)
        return y + 1

    out = torch.compile(step, fullgraph=True)(torch.full((4,), float(dist.get_rank() + 1)))
    return out.tolist()


def version_counter_bumps() -> bool:
    """Autograd sees the in-place write: a tensor saved for backward then modified by the
    op makes backward raise, as any in-place op would."""
    w = torch.ones(3, requires_grad=True)
    y = w * 1.0
    z = (y * y).sum()  # saves y
    torch.ops.pycomm.all_reduce_(y.detach(), "sum", dist.group.WORLD.group_name)
    return _backward_refused(z)


def version_counter_bumps_on_the_eager_path() -> bool:
    """The same through ``pycomm.all_reduce_``'s eager (native) path."""
    w = torch.ones(3, requires_grad=True)
    y = w * 1.0
    z = (y * y).sum()
    pycomm.all_reduce_(y.detach())
    return _backward_refused(z)


def _backward_refused(z: torch.Tensor) -> bool:
    try:
        z.backward()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return False


def bad_input_errors() -> list[str]:
    name = dist.group.WORLD.group_name
    msgs = []
    for call in (lambda: torch.ops.pycomm.all_reduce_(torch.ones(2), "mean", name),
                 lambda: torch.ops.pycomm.all_reduce_(torch.ones(2), "sum", "no-such-group"),
                 lambda: torch.ops.pycomm.all_reduce_(torch.ones(2, dtype=torch.complex64),
                                                      "sum", name)):
        try:
            call()
            msgs.append("no error")
        except Exception as e:  # the message is what is checked
            msgs.append(f"{type(e).__name__}: {e}".splitlines()[0])
    x = torch.ones(2)  # the group still works after the refusals
    torch.ops.pycomm.all_reduce_(x, "sum", name)
    msgs.append(str(x.tolist()))
    return msgs
