"""A pycomm job's life: launched by torchrun, groups destroyed and created again over the
same store, a rank killed in the middle of a large collective, ranks started with
different settings.

Every case uses short timeouts so that a bug fails the test instead of hanging it; the
autouse conftest checks add that nothing is left in /dev/shm and no process survives.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _leaks
import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankFailure, run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")

ROOT = Path(__file__).resolve().parent.parent
PG_TIMEOUT_S = 5.0
SLACK_S = 5.0  # "within the group timeout + a few seconds"


def _pycomm_shm() -> set[str]:
    """pycomm's names in /dev/shm, less those of live processes of other test runs."""
    return _leaks.pycomm_shm()


def _rank_pattern(rank: int) -> str:
    """'rank 2', 'ranks [2]', 'rank(s) 2 did not arrive', 'missing rank(s): 2' ..."""
    return rf"rank\D{{0,20}}\b{rank}\b"


# --- torchrun (env://) ----------------------------------------------------------------


def test_torchrun_env_launch():
    """`python -m torch.distributed.run --standalone --nproc-per-node 2` on a worker that
    calls init_process_group("pycomm") with env://, checks collectives, destroys."""
    before = _pycomm_shm()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYCOMM_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    env.pop("PYCOMM_DEBUG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "tests" / "_torchrun_worker.py")]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{out[-6000:]}"
    checks = "all_reduce[10],all_reduce[300001],all_reduce[arena],all_gather,broadcast," \
             "reduce_scatter"
    for rank in (0, 1):
        assert f"rank {rank} of 2: ok ProcessGroupPycomm {checks}" in done.stdout, out[-6000:]
    assert _pycomm_shm() <= before, f"left in /dev/shm: {sorted(_pycomm_shm() - before)}"


# --- destroy and init again over the same store ---------------------------------------

STAGGER_S = 0.4  # one rank arrives this much later at each init
STORE_TIMEOUT_S = 3 * PG_TIMEOUT_S  # a store get that never returns fails, not hangs


def _shared_store() -> dist.TCPStore:
    """One raw TCPStore for every incarnation (rank 0 serves it; its port travels over the
    store of the group the ranks started with)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    first = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        first.set("lifecycle/port", str(store.port))
        return store
    port = int(first.get("lifecycle/port"))
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)


def _ops_ok(group, what: str) -> None:
    """Collectives of every path on ``group`` (None: the default), checked exactly."""
    import pycomm

    if group is None:
        group = dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    weights = float(sum(range(1, n + 1)))
    for count in (10, 300_001):  # direct, ring
        t = torch.arange(count, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(t, group=group)
        want = torch.arange(count, dtype=torch.float64) * weights
        assert torch.equal(t, want), f"{what}: all_reduce of {count} wrong on rank {rank}"
    a = pycomm.empty(1 << 18).fill_(rank + 1)  # zero-copy (flat groups)
    dist.all_reduce(a, group=group)
    assert bool((a == weights).all()), f"{what}: arena all_reduce wrong on rank {rank}"
    out = torch.empty(n * 1000, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.full((1000,), rank, dtype=torch.int64), group=group)
    assert torch.equal(out, torch.arange(n).repeat_interleave(1000)), f"{what}: all_gather"
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=dist.get_global_rank(group, n - 1), group=group)
    assert bool((b == n - 1).all()), f"{what}: broadcast"


def _init(store, rank: int, world: int, incarnation: int, late: int) -> float:
    """init_process_group on ``store``; rank ``late`` arrives STAGGER_S after the others."""
    if rank == late:
        time.sleep(STAGGER_S)
    start = time.monotonic()
    try:
        dist.init_process_group("pycomm", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    except Exception as exc:
        raise AssertionError(f"rank {rank}: init of incarnation {incarnation} failed after "
                             f"{time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}"
                             ) from exc
    return time.monotonic() - start


def _fail_the_group(incarnation: int) -> str:
    """The last rank stays away from an all_reduce until the others time out; then every
    rank's group is failed (the late rank's call must raise too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1000)
    if rank == world - 1:
        time.sleep(PG_TIMEOUT_S + 1.0)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as exc:  # DistBackendError on the waiting ranks
        elapsed = time.monotonic() - start
        assert elapsed <= PG_TIMEOUT_S + SLACK_S, f"incarnation {incarnation}: took {elapsed}"
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"rank {rank}: incarnation {incarnation}'s all_reduce with a rank "
                         "missing succeeded")


def _reinit_cycles(cycles: int, subgroup: bool, local_size: int | None, fail: bool) -> list:
    """Destroy the group and create it again ``cycles`` times over one store; check every
    incarnation (and a subgroup made in it); optionally fail each one before destroying
    it. The last incarnation is left for run_ranks to destroy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _shared_store()
    saved = os.environ.get("PYCOMM_LOCAL_SIZE")
    if local_size is not None:
        os.environ["PYCOMM_LOCAL_SIZE"] = str(local_size)
    report = []
    dist.destroy_process_group()  # the group run_ranks made, on its own store
    for i in range(cycles + 1):
        # rank 0 (which creates the segment) late, then a joiner late, alternately
        late = 0 if i % 2 == 0 else world - 1
        took = _init(store, rank, world, i, late)
        kind = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
        want = "ProcessGroupIslands" if local_size == 1 else "ProcessGroupPycomm"
        assert kind == want, f"rank {rank}: incarnation {i} is a {kind}, not a {want}"
        _ops_ok(None, f"incarnation {i}")
        if subgroup:
            for ranks in ([0, world - 1], list(range(1, world))):
                g = dist.new_group(ranks, backend="pycomm",
                                   timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
                if rank in ranks:
                    _ops_ok(g, f"incarnation {i}, subgroup {ranks}")
        report.append((i, round(took, 2)))
        if i == cycles:
            break  # leave this one to run_ranks
        if fail:
            report.append(_fail_the_group(i))
        dist.destroy_process_group()
    if saved is None:
        os.environ.pop("PYCOMM_LOCAL_SIZE", None)
    else:
        os.environ["PYCOMM_LOCAL_SIZE"] = saved
    return report


REINIT = {  # id -> (world, subgroup, PYCOMM_LOCAL_SIZE, fail each incarnation)
    "plain": (3, False, None, False),
    "subgroups": (3, True, None, False),
    "islands-subgroups": (3, True, 1, False),
    "after-failure": (3, False, None, True),
    "islands-after-failure": (3, False, 1, True),
}


@pytest.mark.parametrize("case", sorted(REINIT))
def test_destroy_and_init_again_over_the_same_store(case):
    """init -> ops -> destroy, three times and once more, in the same processes over one
    TCPStore; each incarnation (and its subgroups) must be correct, and a failed
    incarnation must not poison the next."""
    world, subgroup, local_size, fail = REINIT[case]
    reports = run_ranks(_reinit_cycles, world, 3, subgroup, local_size, fail,
                        pg_timeout_s=PG_TIMEOUT_S, timeout_s=150.0)
    for rank, report in enumerate(reports):
        inits = [r for r in report if isinstance(r, tuple)]
        assert [i for i, _ in inits] == [0, 1, 2, 3], f"rank {rank}: {report}"
        assert all(took < PG_TIMEOUT_S for _, took in inits), f"rank {rank}: {report}"


# --- a rank killed in the middle of a large collective --------------------------------

BIG = 16 << 20  # float32 elements: 64 MiB, far above the direct size (ring / zero-copy)
QUEUE = 8  # all_reduces queued back to back; the kill lands inside one of them


def _killed_mid_collective(victim: int, arena: bool) -> dict:
    """Every rank queues QUEUE all_reduces of one 64 MiB tensor (async, so they run back
    to back on pycomm's worker thread); the victim SIGKILLs itself half an all_reduce after
    the first finished, so inside one of those still queued, not between two. Every survivor must
    raise DistBackendError naming it, within the timeout."""
    import pycomm

    rank = dist.get_rank()
    x = pycomm.empty(BIG) if arena else torch.empty(BIG)
    x.fill_(1.0)
    dist.all_reduce(x)  # first touch, peers' slabs mapped: not timed
    start = time.monotonic()
    dist.all_reduce(x)
    took = torch.tensor([time.monotonic() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    one = float(took)
    delay = one * QUEUE / 2
    x.fill_(1.0)
    if rank == victim:
        works = [dist.all_reduce(x, async_op=True) for _ in range(QUEUE)]
        # Killed by progress, not by the clock alone (one timed all_reduce misjudges a
        # loaded machine): once the first is done, half an all_reduce later, inside the
        # second or a later one of the QUEUE - 1 still queued.
        works[0].wait()
        time.sleep(one / 2)
        os.kill(os.getpid(), signal.SIGKILL)
        for work in works:
            work.wait()
        raise AssertionError(f"victim rank {rank}: {QUEUE} all_reduces of {one:.3f} s each "
                             f"ended before the kill at {delay:.3f} s")
    # Twice the victim's: those past its QUEUE cannot finish without it, so even a kill
    # that a loaded machine delays past the victim's last all_reduce fails every survivor
    # (between two ops then, where it is normally inside one).
    works = [dist.all_reduce(x, async_op=True) for _ in range(2 * QUEUE)]
    start = time.monotonic()
    failed: tuple[int, float, str] | None = None
    for i, work in enumerate(works):
        try:
            work.wait()
        except dist.DistBackendError as exc:
            failed = (i, time.monotonic() - start, str(exc))
            break
    if failed is None:
        raise AssertionError(f"rank {rank}: all {2 * QUEUE} all_reduces succeeded although "
                             f"rank {victim} was killed during them")
    failed_op, elapsed, message = failed
    assert elapsed <= delay + PG_TIMEOUT_S + SLACK_S, (
        f"rank {rank}: took {elapsed:.1f} s to fail (kill at {delay:.2f} s): {message}")
    missing = [p for p in ("pycomm", "all_reduce", _rank_pattern(victim))
               if not re.search(p, message)]
    assert not missing, f"rank {rank}: the error lacks {missing}: {message!r}"
    print(f"rank {rank}: all_reduce {failed_op} of {QUEUE} failed {elapsed:.2f} s after the "
          f"queue started (kill at {delay:.2f} s, {one:.3f} s per op): {message}", flush=True)
    return {"failed_op": failed_op, "elapsed": elapsed, "delay": delay, "message": message}


@pytest.mark.parametrize(("world", "victim", "arena"), [
    (4, 2, False), (3, 0, False),  # the ring
    (4, 3, True), (3, 1, True),  # zero-copy on pycomm.empty tensors
], ids=["ring-4-ranks-victim2", "ring-3-ranks-victim0", "zero-copy-4-ranks-victim3",
        "zero-copy-3-ranks-victim1"])
def test_rank_killed_in_the_middle_of_a_large_all_reduce(world, victim, arena):
    before = _pycomm_shm()
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_mid_collective, world, victim, arena, pg_timeout_s=PG_TIMEOUT_S,
                  timeout_s=120.0)
    failures = info.value.failures
    # The survivors checked their own errors (naming the victim, in time); any failed
    # check would be listed here as "raised".
    assert set(failures) == {victim}, f"only the victim may fail:\n{info.value}"
    assert failures[victim].kind == "died" and "SIGKILL" in failures[victim].message, (
        str(info.value))
    assert time.monotonic() - start < 120.0
    assert _pycomm_shm() <= before, f"left in /dev/shm: {sorted(_pycomm_shm() - before)}"


# --- ranks started with different settings --------------------------------------------

SKEW_TIMEOUT_S = 10.0  # long enough that "failed at init" and "hung until the timeout"
# cannot be confused
SKEWS = {  # id -> (world, rank_env, variable, {rank: its value as the error may name it})
    "ALGO-rank0-ring": (3, {0: {"PYCOMM_ALGO": "ring"}}, "PYCOMM_ALGO",
                        {0: r"ring", 1: r"auto|unset|not set|default"}),
    "ALGO-rank2-direct": (3, {2: {"PYCOMM_ALGO": "direct"}}, "PYCOMM_ALGO",
                          {2: r"direct", 0: r"auto|unset|not set|default"}),
    "ZERO_COPY-rank0-off": (3, {0: {"PYCOMM_ZERO_COPY": "0"}}, "PYCOMM_ZERO_COPY",
                            {0: r"0|off|false", 1: r"1|on|true|unset|not set|default"}),
    "ZERO_COPY-rank1-off": (2, {1: {"PYCOMM_ZERO_COPY": "0"}}, "PYCOMM_ZERO_COPY",
                            {1: r"0|off|false", 0: r"1|on|true|unset|not set|default"}),
    # The 300_001-element all_reduce takes the two-shot on one rank, the ring on another.
    "TWO_SHOT-rank1-off": (3, {1: {"PYCOMM_TWO_SHOT_BYTES": "0"}}, "PYCOMM_TWO_SHOT_BYTES",
                           {1: r"0|off", 0: r"\d{6,}|unset|not set|default"}),
    "TWO_SHOT_PIECE-rank0-4096": (3, {0: {"PYCOMM_TWO_SHOT_PIECE_BYTES": "4096"}},
                                  "PYCOMM_TWO_SHOT_PIECE_BYTES",
                                  {0: r"4096", 2: r"524288|unset|not set|default"}),
}


def _skewed_ops() -> list[str]:
    """Ops whose algorithm each of the skewed settings decides: small and large
    all_reduce, zero-copy all_reduce, broadcast and reduce_scatter on arena tensors, an
    all_to_all of arena inputs. Returns what was wrong ([] if nothing)."""
    import pycomm

    rank, n = dist.get_rank(), dist.get_world_size()
    bad = []
    for count in (100, 300_001):
        t = torch.full((count,), float(rank + 1))
        dist.all_reduce(t)
        if not bool((t == n * (n + 1) / 2).all()):
            bad.append(f"all_reduce[{count}]")
    a = pycomm.empty(1 << 20).fill_(rank + 1)
    dist.all_reduce(a)
    if not bool((a == n * (n + 1) / 2).all()):
        bad.append("arena all_reduce")
    b = pycomm.empty(1 << 20).fill_(rank)
    dist.broadcast(b, src=n - 1)
    if not bool((b == n - 1).all()):
        bad.append("arena broadcast")
    full = pycomm.empty(n << 18).fill_(rank + 1)
    out = pycomm.empty(1 << 18)
    dist.reduce_scatter_tensor(out, full)
    if not bool((out == n * (n + 1) / 2).all()):
        bad.append("arena reduce_scatter")
    src = pycomm.empty(n * 4096).fill_(rank)
    dst = torch.empty(n * 4096)
    dist.all_to_all_single(dst, src)
    if not torch.equal(dst, torch.arange(n, dtype=torch.float32).repeat_interleave(4096)):
        bad.append("arena all_to_all")
    return bad


def _strip_ranks(message: str) -> str:
    """The message without "rank 0" / "ranks 0, 1" (so a value "0" is not a rank)."""
    return re.sub(r"\branks?\W{0,4}\d+(\W{1,4}\d+)*", " ", message)


@pytest.mark.parametrize("case", sorted(SKEWS))
def test_ranks_with_different_settings_fail_at_init_or_agree(case):
    """Ranks started with a different PYCOMM_ALGO or PYCOMM_ZERO_COPY: every rank fails in
    init_process_group with an error naming the variable and both values, or they agree
    and every op is right. Either way well before the group timeout."""
    world, rank_env, variable, values = SKEWS[case]
    start = time.monotonic()
    try:
        results = run_ranks(_skewed_ops, world, rank_env=rank_env, pg_timeout_s=SKEW_TIMEOUT_S,
                            timeout_s=SKEW_TIMEOUT_S * 3)
    except RankFailure as failure:
        elapsed = time.monotonic() - start
        failed_at_init = {r: f for r, f in failure.failures.items()
                          if f.kind == "raised" and "while init_process_group" in f.message}
        assert set(failed_at_init) == set(range(world)), (
            f"{variable} skew: not every rank failed at init (after {elapsed:.1f} s; group "
            f"timeout {SKEW_TIMEOUT_S} s):\n{failure}")
        for rank, err in failed_at_init.items():
            text = _strip_ranks(err.message)
            lacks = [p for p in (variable, *values.values())
                     if not re.search(rf"(?<![\w.])({p})(?![\w.])", text)]
            assert not lacks, f"rank {rank}: the init error lacks {lacks}: {err.message!r}"
        assert elapsed < SKEW_TIMEOUT_S, f"init took {elapsed:.1f} s to fail"
        return
    elapsed = time.monotonic() - start
    assert results == [[]] * world, f"{variable} skew: ranks agreed, but: {results}"
    assert elapsed < SKEW_TIMEOUT_S, f"{variable} skew: took {elapsed:.1f} s"
