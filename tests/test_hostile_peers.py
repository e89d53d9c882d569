"""Hostile and unusual environments: nothing lost, nothing silently wrong.

- Ranks in separate PID namespaces that share /dev/shm and the network (containers run
  with ``--ipc=host --net=host``) get right results (zero-copy falls back to the copy
  path, since /proc/<pid> names other processes there) and see a dead peer as dead.
- A peer that posts a bogus zero-copy offer (an offset past its slab, another file's
  identity) gets a clear error naming it, never a crash or a write out of bounds.
- A segment named by the store is mapped only if this user owns it, nobody else can
  read it, and it is as large as announced.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import held_store, run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")

ROOT = Path(__file__).resolve().parent.parent
PG_TIMEOUT_S = 20.0


# --- a peer that posts bogus zero-copy offers ---------------------------------------


def _bogus_offer_case(op: str, offset_skew: int, inode_skew: int) -> str:
    """Rank 1 posts skewed offers; every rank must raise, rank 0 naming rank 1."""
    import pycomm
    from pycomm import _C

    rank = dist.get_rank()
    n = 1 << 18  # 1 MiB of float32: above the direct size, so zero-copy is negotiated
    x = pycomm.empty((n,), dtype=torch.float32)
    x.fill_(rank + 1)
    if rank == 1:
        _C._inject_offer_faults(offset_skew, inode_skew)
    try:
        if op == "all_reduce":
            dist.all_reduce(x)
        else:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x)
    except dist.DistBackendError as exc:
        return str(exc)
    finally:
        _C._inject_offer_faults(0, 0)
    raise AssertionError(f"rank {rank}: a bogus offer was used without an error")


@pytest.mark.parametrize(("op", "offset_skew", "inode_skew", "why"), [
    ("all_reduce", 1 << 40, 0, r"offset \d+ of a \d+-byte slab"),
    ("all_to_all", 1 << 40, 0, r"offset \d+ of a \d+-byte slab"),
    ("all_reduce", 0, 1, "is not the slab it posted"),
])
def test_bogus_offer_is_refused_naming_the_peer(op, offset_skew, inode_skew, why):
    messages = run_ranks(_bogus_offer_case, 2, op, offset_skew, inode_skew,
                         pg_timeout_s=PG_TIMEOUT_S)
    assert re.search(r"rank 0 cannot use the arena memory of rank 1", messages[0]), messages[0]
    assert re.search(why, messages[0]), messages[0]
    # Rank 1 learns of it too, through the job's abort record.
    assert "rank 1" in messages[1] and re.search(why, messages[1]), messages[1]


# --- segments named by the store ----------------------------------------------------


@pytest.fixture
def planted_segment():
    """A file in /dev/shm with a name pycomm could have made; removed afterwards."""
    path = Path(f"/dev/shm/pycomm-{os.getpid()}-{os.urandom(8).hex()}")
    yield path
    path.unlink(missing_ok=True)


def _open_error(name: str, nbytes: int) -> str:
    from pycomm import _C

    with pytest.raises(RuntimeError) as info:
        _C._open_segment(name, nbytes)
    return str(info.value)


def test_segment_readable_by_others_is_refused(planted_segment):
    planted_segment.write_bytes(b"\0" * 8192)
    planted_segment.chmod(0o644)
    assert "mode 0644 lets other users in" in _open_error("/" + planted_segment.name, 4096)


def test_segment_shorter_than_announced_is_refused(planted_segment):
    planted_segment.write_bytes(b"\0" * 4096)
    planted_segment.chmod(0o600)
    message = _open_error("/" + planted_segment.name, 1 << 20)
    assert "holds 4096 bytes, less than the 1048576 announced" in message


def test_segment_of_another_user_is_refused(planted_segment):
    if os.geteuid() != 0:
        pytest.skip("no root: making a file owned by another user needs it")
    planted_segment.write_bytes(b"\0" * 8192)
    planted_segment.chmod(0o600)
    os.chown(planted_segment, 65534, 65534)
    assert "owned by uid 65534, not by this user" in _open_error("/" + planted_segment.name, 4096)


@pytest.mark.parametrize("name", ["/etc-passwd", "/pycomm-12-short", "/pycomm-x-0123456789abcdef",
                                  "/pycomm-1-0123456789abcdef/../x"])
def test_segment_names_pycomm_does_not_make_are_refused(name):
    assert "not a name pycomm creates" in _open_error(name, 4096)


# --- ranks in separate PID namespaces -----------------------------------------------

PIDNS_RANK = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import pycomm

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    # Arena tensors first: both ranks' slabs get the same descriptor number, so
    # "/proc/1/fd/<it>" opens a valid slab in either namespace: the rank's own.
    xs = [pycomm.empty((n,), dtype=torch.float64) for n in (1000, 1 << 20)]
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # the test holds it
    dist.init_process_group("pycomm", store=store, rank=rank, world_size=world)
    print("pid", os.getpid(), flush=True)
    for x in xs:  # direct, then zero-copy-eligible sizes
        x.fill_(rank + 1)
        dist.all_reduce(x)
        want = world * (world + 1) / 2
        assert bool((x == want).all()), f"rank {rank}: got {x[:4].tolist()}, want {want}"
    print("sums ok", flush=True)
    dist.barrier()
    if rank == 1:
        # Dies without a word (as pid 1 of its namespace it cannot SIGKILL itself).
        time.sleep(0.5)
        os._exit(1)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20))
        print("no error", flush=True)
    except dist.DistBackendError as exc:
        print(f"error after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    os._exit(0)
""")


def _unshare_unavailable() -> str | None:
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no PID namespaces: unshare not available ({exc})"
    if done.returncode != 0:
        return f"no PID namespaces: unshare --pid not permitted: {done.stderr.decode().strip()}"
    return None


def test_ranks_in_separate_pid_namespaces(tmp_path):
    """Each rank is pid 1 of its own namespace, sharing /dev/shm and the network: zero-copy
    must not map "/proc/1/fd/N" (its own file), and a killed peer must be seen dead (a
    pid check would find the survivor's own pid 1 alive)."""
    if reason := _unshare_unavailable():
        pytest.skip(reason)
    script = tmp_path / "rank.py"
    script.write_text(PIDNS_RANK)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYCOMM_DEBUG="TRACE",
               PYCOMM_TIMEOUT_S=str(int(PG_TIMEOUT_S)))
    with held_store(2) as port:
        procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                                   str(script), str(rank), "2", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
                 for rank in range(2)]
        try:
            outs = [p.communicate(timeout=120)[0].decode() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
    for rank, out in enumerate(outs):
        assert "pid 1\n" in out, f"rank {rank} is not pid 1 of its namespace:\n{out}"
        assert "sums ok" in out, f"rank {rank}:\n{out}"
    assert "the ranks are in different PID namespaces" in outs[0], outs[0]
    died = re.search(r"error after ([\d.]+) s: (.*)", outs[0])
    assert died, f"rank 0 did not see rank 1 die:\n{outs[0]}"
    assert float(died.group(1)) < PG_TIMEOUT_S / 2, died.group(0)
    named = re.search(r"rank 1 \(pid 1 in another PID namespace\) died", died.group(2))
    assert named, died.group(2)
