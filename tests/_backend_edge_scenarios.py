"""Rank bodies for tests/test_backend_edges.py (importable by the spawned ranks)."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

import pycomm


def _outcome(fn) -> str:
    """"ok <value>" or "error <message>"."""
    try:
        return f"ok {fn()}"
    except Exception as exc:
        return f"error {exc}"


def slow_callback_then_ops(slow_s: dict[int, float]) -> tuple[str, str, bool]:
    """An op whose future callback is slow on some ranks, then an op queued behind it
    (B) and one issued after (D). Returns B's and D's outcomes, and whether the callback
    ran on the caller's thread (the op was complete when it was attached, so torch ran
    it at once: nothing held the group's order, and the case did not happen)."""
    r = dist.get_rank()
    # 16 MB: the op is usually still moving when the callback is attached on every rank
    # (a small one is complete by then on the rank that came second).
    a = torch.ones(1 << 22)
    w = dist.all_reduce(a, async_op=True)
    on_caller: list[bool] = []

    def slow(fut):
        on_caller.append(threading.current_thread() is threading.main_thread())
        time.sleep(slow_s.get(r, 0.0))
        return fut.value()

    w.get_future().then(slow)
    b = torch.full((10,), 100.0 * (r + 1))
    wb = dist.all_reduce(b, async_op=True)
    got_b = _outcome(lambda: (wb.wait(), b[0].item())[1])
    time.sleep(max(0.0, max(slow_s.values()) + 0.3 - 0.0))
    d = torch.ones(10)
    got_d = _outcome(lambda: (dist.all_reduce(d), d[0].item())[1])
    return got_b, got_d, any(on_caller)


def progressing_callback_then_op(seconds: float, steps: int) -> tuple[str, list[float]]:
    """A callback that runs `steps` nested all_reduces over `seconds` (longer than the
    group's timeout) with an op queued behind it: progress, so no stall."""
    r = dist.get_rank()
    w = dist.all_reduce(torch.ones(4), async_op=True)
    nested: list[float] = []

    def progressing(fut):
        for _ in range(steps):
            time.sleep(seconds / steps)
            x = torch.ones(4)
            dist.all_reduce(x)
            nested.append(x[0].item())
        return fut.value()

    w.get_future().then(progressing)
    b = torch.full((4,), float(r + 1))
    wb = dist.all_reduce(b, async_op=True)
    return _outcome(lambda: (wb.wait(), b[0].item())[1]), nested


def callback_issues_op_during_destroy(what: str) -> str:
    """Rank 0's pending irecv on a group is failed by destroy_process_group(group); its
    future callback issues `what` on that group then. Returns what the callback saw
    ("" on rank 1)."""
    r = dist.get_rank()
    g = dist.new_group([0, 1])
    seen: list[str] = []
    if r == 0:
        w = dist.irecv(torch.empty(4), src=1, group=g)

        def issue(_fut):
            x = torch.ones(1)
            op = {"all_reduce": lambda: dist.all_reduce(x, group=g),
                  "send": lambda: dist.send(x, dst=1, group=g),
                  "fast": lambda: pycomm.all_reduce_(x, group=g)}[what]
            seen.append(_outcome(op))

        w.get_future().then(issue)
        time.sleep(0.3)
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    return seen[0] if seen else ""


def bad_sizes() -> list[str]:
    """Sizes whose int64 arithmetic wraps, on every rank (each must be refused at the
    call, naming it, and leave the group usable)."""
    n = dist.get_world_size()
    big = 2**63 - 1
    out = []
    inp = torch.arange(2, dtype=torch.float32)
    out.append(_outcome(lambda: dist.all_to_all_single(
        torch.empty(2), inp, output_split_sizes=[1, 1] + [0] * (n - 2),
        input_split_sizes=[big, big] + [4] * (n - 2))))
    huge = torch.empty(1).expand(2**62)  # stride 0: 2**62 elements, 16 EiB of float32
    out.append(_outcome(lambda: dist.all_reduce(huge)))
    out.append(_outcome(lambda: dist.all_gather([huge] * n, huge)))
    ok = torch.ones(3)
    dist.all_reduce(ok)
    out.append(f"ok {ok[0].item()}")
    return out


def zero_elements_against_ten() -> tuple[str, str]:
    """Rank 0 reduces 0 elements, the others 10: a mismatch at that op on every rank."""
    r = dist.get_rank()
    t = torch.ones(0 if r == 0 else 10)
    first = _outcome(lambda: dist.all_reduce(t))
    u = torch.ones(10)
    second = _outcome(lambda: (dist.all_reduce(u), u[0].item())[1])
    return first, second


def empty_ops_everywhere() -> list[float]:
    """0 elements on every rank: each op meets the others and succeeds."""
    n = dist.get_world_size()
    e = torch.ones(0)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)
    dist.all_gather_into_tensor(torch.empty(0), e)
    dist.reduce_scatter_tensor(torch.empty(0), torch.empty(0))
    outs = [torch.empty(0) for _ in range(n)]
    dist.all_gather(outs, e)
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def fast_path_on_a_group_without_this_rank() -> tuple[float, bool]:
    """pycomm.all_reduce_ on a group this rank is not in: as dist.all_reduce, nothing
    happens there (with a warning), and the members reduce."""
    import warnings

    g = dist.new_group([0])
    t = torch.ones(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pycomm.all_reduce_(t, group=g)
    warned = any("not a member" in str(w.message) for w in caught)
    dist.destroy_process_group(g)
    return t[0].item(), warned


def _link_ok(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
        return True
    except OSError:
        return False


def fork_child_and_parent() -> dict[str, object]:
    """Rank 0 forks a child after init: the child's op is refused naming the fork, its
    arena is its own, it holds nothing of the segment, its destroy_process_group returns
    at once and leaves the parent's group alone; the parent's group goes on."""
    r = dist.get_rank()
    res: dict[str, object] = {}
    t = torch.ones(4)
    dist.all_reduce(t)
    if r == 0:
        a = pycomm.empty(1024)
        a.fill_(1.0)
        read_r, write_w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: report, then exit through the interpreter's finalization
            os.close(read_r)
            b = pycomm.empty(1024)
            b.fill_(7.0)  # must not land in the parent's next block
            a.fill_(5.0)  # its copy of the parent's tensor: private to the child
            msg = _outcome(lambda: dist.all_reduce(torch.ones(1)))
            # The parent's segment would keep its liveness lock (and a killed parent
            # would look alive) while the child maps or holds it.
            with open("/proc/self/maps") as maps:
                held = [line for line in maps if "/dev/shm/pycomm" in line]
            holds = bool(held)
            holds = holds or any("/dev/shm/pycomm" in os.readlink(f"/proc/self/fd/{f}")
                                 for f in os.listdir("/proc/self/fd") if _link_ok(f))
            msg = f"holds_segment={holds} {held} {msg}"
            # Tearing its copy down must neither hang (joining threads it does not have)
            # nor tell the parent's peers that rank 0 left.
            dist.destroy_process_group()
            os.write(write_w, msg.encode()[:4000])
            os.close(write_w)
            os._exit(0)
        os.close(write_w)
        c = pycomm.empty(1024)
        res["parent_fresh_block"] = c[0].item() if c.numel() else None
        c.fill_(3.0)
        with os.fdopen(read_r, "rb") as f:
            res["child_op"] = f.read().decode()
        _, status = os.waitpid(pid, 0)
        res["child_exit_s"] = time.monotonic() - t0
        res["child_status"] = status
        res["parent_a"] = a[0].item()
    dist.barrier()
    x = torch.ones(4)
    dist.all_reduce(x)
    res["after"] = x[0].item()
    return res
