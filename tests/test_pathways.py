"""pycomm.parallel.pathways: one controller, islands of workers, futures, gang scheduling.

One cluster of two islands (two workers each) serves most cases; the cases that break a
cluster (a deadlock with the scheduler off, a killed worker) or need another shape (a
four-worker island for dp x tp) have their own.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from pathlib import Path

import _pathways_fns as fns
import pytest
import torch

from bench import _pathways_programs as programs
from pycomm.parallel import pathways as pw
from pycomm.parallel.pathways.fair_share import FairShare
from pycomm.parallel.pathways.mesh_context import _slice, _unravel
from pycomm.parallel.pathways.protocol import transfer_tag
from pycomm.parallel.pathways.scheduler import IslandScheduler, _InFlight
from pycomm.parallel.pathways.worker import _quoted as worker_quoted

pytestmark = pytest.mark.usefixtures("require_pycomm")

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}", "OMP_NUM_THREADS": "1"}
F64 = torch.float64
V8 = pw.spec((8,), F64)


LAUNCHERS = ["local", "ray"]


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the session (the same tests run on Ray's launcher)."""
    try:
        import ray
    except ModuleNotFoundError:
        pytest.skip("no Ray: pip install 'pycomm-collectives[ray]'")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ENV})
    yield ray
    ray.shutdown()


def _launcher(kind: str, request: pytest.FixtureRequest, sizes: list[int]) -> object:
    if kind == "local":
        return None
    request.getfixturevalue("ray_session")
    from pycomm.parallel.pathways.ray_launch import RayLauncher

    return RayLauncher(sizes, cpus_per_worker=0.5)


@pytest.fixture(scope="module", params=LAUNCHERS)
def cluster(request):
    """Two islands of two workers, started by each launcher in turn."""
    launcher = _launcher(request.param, request, [2, 2])
    with pw.Cluster([2, 2], launcher=launcher, timeout_s=60, env=ENV) as c:  # type: ignore[arg-type]
        yield c


@pytest.fixture(scope="module")
def four():
    """One island of four workers (a dp x tp mesh)."""
    with pw.Cluster([4], timeout_s=120, env=ENV) as c:
        yield c


@pytest.fixture
def client(cluster):
    with cluster.client(timeout_s=60) as c:
        yield c


# --- pure parts ---------------------------------------------------------------------


def test_stride_order_gives_shares_by_weight():
    share: FairShare[str] = FairShare()
    share.add_client(0, 1.0)
    share.add_client(1, 2.0)
    for i in range(30):
        share.push(0, f"a{i}")
        share.push(1, f"b{i}")
    order = [share.pop(lambda _: True, lambda _: 1.0) for _ in range(30)]
    clients = [c for c, _ in order if c is not None]  # type: ignore[misc]
    assert clients.count(1) == 20 and clients.count(0) == 10
    # each client's own items keep their order
    assert [i for c, i in order if c == 0] == [f"a{k}" for k in range(10)]  # type: ignore[misc]


def test_a_client_back_from_idle_is_not_owed_its_idle_time():
    share: FairShare[int] = FairShare()
    share.add_client(0, 1.0)
    share.add_client(1, 1.0)
    for i in range(10):
        share.push(0, i)
    for _ in range(10):
        share.pop(lambda _: True, lambda _: 1.0)
    for i in range(4):
        share.push(0, i)
        share.push(1, i)
    order = [share.pop(lambda _: True, lambda _: 1.0)[0] for _ in range(8)]  # type: ignore[index]
    assert order.count(1) == 4 and order[:4].count(1) <= 3, order


def test_weights_must_be_positive():
    with pytest.raises(ValueError, match="weight must be positive"):
        FairShare().add_client(3, 0.0)


def test_transfer_tags_are_distinct_positive_pairs():
    tags = {transfer_tag(c, s) for c in range(1024) for s in (0, 1, 2, (1 << 20) - 1)}
    assert len(tags) == 1024 * 4
    assert all(t >= 0 and t + 1 < 2**31 and t % 2 == 0 for t in tags)


def test_mesh_coordinates_and_slices():
    assert _unravel(5, (2, 3)) == (1, 2)
    grid = torch.arange(6).view(2, 3)
    assert _slice(grid, 0, {"dp": 1, "tp": 2}) == (2, 5)
    assert _slice(grid, 1, {"dp": 1, "tp": 2}) == (3, 4, 5)


def test_address_round_trips(cluster):
    text = str(cluster.address)
    assert pw.ClusterAddress.parse(text) == cluster.address
    with pytest.raises(ValueError, match="not a pathways address"):
        pw.ClusterAddress.parse("tcp://x")


# --- calls and futures --------------------------------------------------------------


def test_a_call_returns_before_its_function_runs(client):
    mesh = client.mesh(0, (2,))
    t0 = time.perf_counter()
    slow = client.call(fns.sleep_then, mesh, 1, 2.0)
    returned = time.perf_counter() - t0
    # had the call waited for its function, it would have taken the function's 2 s
    assert not slow.done() and returned < 1.0, returned
    assert slow.result() == [1, 1]


def test_collectives_on_a_mesh_equal_the_float64_reference(client):
    mesh = client.mesh(1, (2,), names=("dp",))
    parts = client.call(fns.rank_value, mesh, 0.5, 8, out=V8)
    total = client.call(fns.summed, mesh, parts, out=V8)
    want = sum(0.5 + i + torch.arange(8, dtype=F64) / 7 for i in range(2))
    for shard in total.result():
        torch.testing.assert_close(shard, want, rtol=0, atol=0)
    assert [d["coords"] for d in client.call(fns.describe, mesh).result()] == [
        {"dp": 0}, {"dp": 1}]


def test_the_default_client_attaches_by_address(cluster):
    with pytest.raises(RuntimeError, match=r"call pathways\.init"):
        pw.mesh(0, (1,))
    client = pw.init(str(cluster.address))
    try:
        with pytest.raises(RuntimeError, match="init\\(\\) was called already"):
            pw.init(str(cluster.address))
        assert fns.doubled(pw.mesh(0, (2,)), torch.ones(8, dtype=F64)).result(0)[0] == 2
        assert pw.client() is client
    finally:
        pw.shutdown()
    with pytest.raises(ValueError, match="address of a cluster, or islands"):
        pw.init()


def test_a_declared_function_is_called_on_a_mesh(client):
    mesh = client.mesh(1, (2,))
    y = fns.doubled(mesh, torch.ones(8, dtype=F64))
    assert y.spec == V8
    torch.testing.assert_close(y.result(1), torch.full((8,), 2.0, dtype=F64))


def test_futures_move_worker_to_worker_in_and_between_islands(client):
    a, b = client.mesh(0, (2,)), client.mesh(1, (2,))
    x = client.call(fns.rank_value, a, 1.0, 8, out=V8)
    crossed = client.call(fns.plus, b, x, 10.0, out=V8)  # gloo pairs, posted early
    back = client.call(fns.summed, a, crossed, out=V8)  # and back
    untyped = client.call(fns.plus, b, back, 1.0)  # no spec: size sent first
    want = [1.0 + i + torch.arange(8, dtype=F64) / 7 for i in range(2)]
    for got, w in zip(crossed.result(), want, strict=True):
        torch.testing.assert_close(got, w + 10, rtol=0, atol=0)
    torch.testing.assert_close(untyped.result(1), sum(want) + 21, rtol=0, atol=0)


def test_a_transfer_that_timed_out_leaves_the_islands_pair_usable():
    """A value that reaches the other island after the timeout fails its receiver (gloo
    then closes the pair on that side); the next transfers between the same two workers,
    in both directions, arrive: the pair is built again, on both sides, at its next use."""
    # (10 s: every wait's limit, start-up's too, which a loaded machine needs)
    with pw.Cluster([1, 1], timeout_s=10, env=ENV) as cluster, \
            cluster.client(timeout_s=60) as client:
        a, b = client.mesh(0, (1,)), client.mesh(1, (1,))
        late = client.call(fns.sleep_then, a, torch.ones(8, dtype=F64), 13.0, out=V8)
        with pytest.raises(pw.PathwaysError, match="transfer failed"):
            client.call(fns.plus, b, late, 1.0, out=V8).result()
        x = client.call(fns.rank_value, a, 1.0, 8, out=V8)
        there = client.call(fns.plus, b, x, 10.0, out=V8)
        back = client.call(fns.plus, a, there, 100.0, out=V8)
        want = (1.0 + torch.arange(8, dtype=F64) / 7) + 10.0 + 100.0
        torch.testing.assert_close(back.result(0), want, rtol=0, atol=0)


def test_objects_that_are_not_tensors_travel_pickled(client):
    a, b = client.mesh(0, (2,)), client.mesh(1, (2,))
    obj = client.call(fns.as_object, a, torch.ones(3))
    assert client.call(fns.from_object, b, obj).result() == [9.0, 10.0]


def test_a_shard_goes_to_every_rank_and_mismatched_meshes_are_refused(client):
    two, one = client.mesh(0, (2,)), client.mesh(1, (1,))
    x = client.call(fns.rank_value, two, 0.0, 8, out=V8)
    with pytest.raises(ValueError, match=r"sharded over 2 ranks \(2,\), the mesh has 1"):
        client.call(fns.plus, one, x, 1.0)
    got = client.call(fns.plus, one, x.shard(1), 1.0, out=V8).result(0)
    torch.testing.assert_close(got, 2.0 + torch.arange(8, dtype=F64) / 7)


def test_a_two_dimensional_mesh_has_a_group_per_dimension(four):
    with four.client() as client:
        mesh = client.mesh(0, (2, 2), names=("dp", "tp"))
        x = client.call(fns.rank_value, mesh, 0.0, 8, out=V8)
        tp = client.call(fns.dim_sum, mesh, x, "tp", out=V8).result()
        for index, got in enumerate(tp):
            row = index // 2 * 2
            torch.testing.assert_close(got, sum(i + torch.arange(8, dtype=F64) / 7
                                                for i in (row, row + 1)), rtol=0, atol=0)
        assert {d["dm"] for d in client.call(fns.describe, mesh).result()} == {(2, 2)}


def test_parallel_dispatch_runs_a_chain_back_to_back(cluster):
    """The chain's nodes start right after their predecessors end when the chain was
    sent whole; sequential dispatch pays a controller round trip between them."""
    gaps = {}
    for mode in ("parallel", "sequential"):
        with cluster.client(dispatch=mode) as client:
            mesh = client.mesh(0, (2,))
            x = client.call(fns.rank_value, mesh, 0.0, 8, out=V8)
            chain = [x]
            for _ in range(40):
                chain.append(client.call(fns.summed, mesh, chain[-1], out=V8))
            got = chain[-1].result(0)
            times = client.timings(chain[1:])
            gaps[mode] = sorted(b[0] - a[1] for a, b in itertools.pairwise(times))[20]
            want = (2**40) * sum(i + torch.arange(8, dtype=F64) / 7 for i in range(2)) / 2
            torch.testing.assert_close(got, want)
    assert gaps["parallel"] < gaps["sequential"], gaps


def test_a_program_is_sent_in_one_message(client):
    mesh = client.mesh(1, (2,))
    with client.program():
        x = client.call(fns.rank_value, mesh, 0.0, 8, out=V8)
        y = client.call(fns.summed, mesh, x, out=V8)
        assert not y.done()
    torch.testing.assert_close(y.result(0), sum(i + torch.arange(8, dtype=F64) / 7
                                                for i in range(2)))


# --- errors -------------------------------------------------------------------------


def test_a_failing_function_names_island_rank_and_function_and_fails_its_dependents(client):
    mesh = client.mesh(0, (2,))
    bad = client.call(fns.fails, mesh, torch.ones(8, dtype=F64), out=V8)
    after = client.call(fns.summed, client.mesh(1, (2,)), bad, out=V8)
    with pytest.raises(pw.PathwaysError, match=r"island 0 rank 1: fails \(node \d+ of client "
                       r"\d+\) raised ValueError: rank-one refuses"):
        bad.wait()
    err = after.exception()
    assert err is not None and "failed" in str(err), err
    # no rank of island 1 ran `summed` (rank 0 had its input): both are free at once
    t0 = time.monotonic()
    other = client.mesh(1, (2,))
    assert client.call(fns.summed, other, torch.ones(8, dtype=F64), out=V8).result(0)[0] == 2
    assert time.monotonic() - t0 < 10  # not the 60 s timeout of a rank left waiting
    # the mesh a function failed on is aborted (its collectives' order is lost): refused
    with pytest.raises(pw.PathwaysError, match=r"was aborted after node \d+ failed"):
        client.call(fns.summed, mesh, torch.ones(8, dtype=F64), out=V8).wait()
    mesh.release()
    fresh = client.mesh(0, (2,))
    assert client.call(fns.summed, fresh, torch.ones(8, dtype=F64), out=V8).result(0)[0] == 2


def test_a_function_that_raises_while_its_peer_waits_in_a_collective_frees_it(client):
    """Rank 1 raises before the all-reduce rank 0 is waiting in: the mesh is aborted, and
    rank 0's wait ends at once with the abort, not at the timeout (60 s)."""
    mesh = client.mesh(0, (2,))
    t0 = time.monotonic()
    bad = client.call(fns.fails_then_sum, mesh, torch.ones(8, dtype=F64), out=V8)
    err = bad.exception()
    assert err is not None and "rank-one refuses" in str(err), err
    assert client.call(fns.summed, mesh, torch.ones(8, dtype=F64)).exception() is not None
    assert time.monotonic() - t0 < 20


def test_a_function_that_hangs_on_one_rank_leaves_the_island_usable_once_it_returns():
    """Rank 0 sleeps past the timeout before the all-reduce rank 1 waits in: the node fails
    at the timeout, the next node on its mesh at once (aborted), a mesh asked for while
    rank 0 still sleeps fails naming why (before: "mesh 1 is not on this worker
    (released?)"), and once rank 0 is back a new mesh runs."""
    with pw.Cluster([2], timeout_s=5, env=ENV) as cluster, cluster.client(timeout_s=60) as c:
        mesh = c.mesh(0, (2,))
        hung = c.call(fns.hangs_on_rank_zero, mesh, torch.ones(8, dtype=F64), 12.0, out=V8)
        err = str(hung.exception())
        assert "timed out after 5" in err and "rank(s) [0] did not arrive" in err, err
        err = str(c.call(fns.summed, mesh, torch.ones(8, dtype=F64), out=V8).exception())
        assert "was aborted after node" in err, err
        busy = c.mesh(0, (2,))
        err = str(c.call(fns.summed, busy, torch.ones(8, dtype=F64), out=V8).exception())
        assert f"mesh {busy.id} of island 0 could not be made" in err, err
        assert "did not arrive" in err, err
        deadline = time.monotonic() + 90
        while True:  # a new mesh per try: one asked for while rank 0 sleeps fails too
            later = c.mesh(0, (2,))
            out = c.call(fns.summed, later, torch.ones(8, dtype=F64), out=V8)
            if out.exception() is None or time.monotonic() > deadline:
                break
        assert out.exception() is None, out.exception()
        assert out.result(0)[0] == 2


def test_functions_from_a_script_travel_by_value(client):
    mesh = client.mesh(1, (2,))
    assert client.call(lambda ctx, k: k + ctx.index, mesh, 40).result() == [40, 41]

    def local(ctx, x):
        return x * 3
    assert client.call(local, mesh, 2).result(1) == 6


def test_futures_inside_containers_and_released_meshes_are_refused(client):
    mesh = client.mesh(0, (1,))
    x = client.call(fns.plus, mesh, 1.0, 1.0)
    with pytest.raises(TypeError, match="future inside a container"):
        client.call(fns.plus, mesh, [x], 1.0)
    with pytest.raises(TypeError, match="future inside a container"):
        client.call(fns.plus, mesh, 1.0, k=x)
    mesh.release()
    with pytest.raises(pw.PathwaysError, match="was released"):
        client.call(fns.plus, mesh, 1.0, 1.0)


def test_an_output_that_is_not_its_spec_is_named(client):
    mesh = client.mesh(0, (1,))
    with pytest.raises(pw.PathwaysError, match=r"declared float64\[8\], returned float32\[3\]"):
        client.call(fns.wrong_shape, mesh, out=V8).wait()


def test_what_cannot_be_sent_is_refused_at_the_call(client):
    mesh = client.mesh(0, (1,))
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be sent to the workers"):
        client.call(lambda ctx: lock, mesh)  # a lambda by value, but its lock is not
    with pytest.raises(ValueError, match=r"cannot place ranks \[0, 5\]"):
        client.mesh(0, (2,), ranks=[0, 5])
    with pytest.raises(ValueError, match="2 names"):
        client.mesh(0, (2,), names=("a", "b"))
    with pytest.raises(ValueError, match=r"shape \(2, 0\): every dimension a positive int"):
        client.mesh(0, (2, 0))
    with pytest.raises(ValueError, match=r"cannot place ranks \[0, 1\] for shape \(8,\)"):
        client.mesh(0, (8,))


# --- gang scheduling and shares ------------------------------------------------------


def test_without_the_scheduler_two_programs_deadlock_and_the_watchdog_names_it():
    with pw.Cluster([2], timeout_s=6, env=ENV, policy="off") as off:
        t0 = time.monotonic()
        out, clients = programs.two_clients_in_opposite_orders(off)
        # Worker 0 waits in client 0's all-reduce for worker 1, which waits in client 1's
        # for worker 0, until the first timeout breaks the cycle (the other may then
        # complete late): client 0's fails, naming the rank that never came.
        err = str(out[0].exception())
        assert ("all_reduce" in err and "timed out after 6" in err
                and "rank(s) [1] did not arrive" in err), err
        assert time.monotonic() - t0 >= 5.5
        for c in clients:
            c.close()


def test_with_the_scheduler_the_same_programs_finish(cluster):
    out, clients = programs.two_clients_in_opposite_orders(cluster)
    for i, f in enumerate(out):
        for shard in f.result():
            torch.testing.assert_close(shard, torch.full((8,), 2 * (i + 1.0), dtype=F64))
    for c in clients:
        c.close()
        with pytest.raises(pw.PathwaysError, match="client is closed"):
            c.mesh(0, (1,))


def test_two_clients_share_an_island_by_weight(cluster):
    """Weights 1 and 2, the same work: the heavier client gets 2/3 of the island while
    both have work there (measured from the workers' clocks). The ratio of busy times
    is a sum of calls' times: its tolerance is 10%, or three standard errors of those
    sums where the calls' own times spread more (a loaded machine stretches them)."""
    share = programs.weighted_share(cluster)
    assert 2.0 * (1 - ratio_tolerance(share["calls_s"])) <= share["ratio"] <= 2.0 * (
        1 + ratio_tolerance(share["calls_s"])), share


def ratio_tolerance(calls: list[list[float]]) -> float:
    """Relative tolerance of a ratio of two sums of call times: 3 standard errors from
    the calls' coefficient of variation (pooled), at least 10%."""
    import statistics

    times = [t for c in calls for t in c]
    counts = [max(len(c), 1) for c in calls]
    cv = statistics.pstdev(times) / statistics.fmean(times) if len(times) > 1 else 1.0
    return max(0.10, 3 * cv * math.sqrt(sum(1 / n for n in counts)))


# --- programs of the papers ---------------------------------------------------------


def test_gpipe_with_stages_on_two_islands_equals_one_process(client):
    got, want = programs.gpipe_on_two_islands(client, micro=4, steps=3)
    flat = [loss for step in got for loss in step]
    assert flat == pytest.approx([loss for step in want for loss in step], rel=1e-6)
    assert got[-1] != got[0]


def test_the_trainer_through_the_controller_is_python_m_parallel_train(four, tmp_path):
    """The project's GPT on a dp2 x tp2 mesh of one island, each step one call, every
    step dispatched at once: the losses of the same layout under python -m pycomm.parallel.train."""
    got, want = programs.trainer_against_parallel_train(four, tmp_path, 4, ENV)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)


def test_the_trainer_refuses_a_mesh_that_is_not_its_island(four):
    from pycomm.parallel.job.config import parse
    from pycomm.parallel.pathways.train import pw_train

    with four.client() as client:
        mesh = client.mesh(0, (2,), names=("dp",))
        with pytest.raises(pw.PathwaysError, match=r"must be the whole island \(4 workers"):
            pw_train(client, mesh, parse(["--dp", "2", "--steps", "1"]))


# --- failure ------------------------------------------------------------------------


class _SlowLastLauncher:
    """Starts workers on this host, the last one ``delay_s`` late (a slow launcher)."""

    def __init__(self, last: tuple[int, int], delay_s: float,
                 env: dict[str, dict[str, str]] | None = None):
        from pycomm.parallel.pathways.launch import LocalLauncher

        self._local, self.last, self.delay_s = LocalLauncher(), last, delay_s
        self.env = env or {}  # per "island.rank": extra settings for that worker alone

    def start(self, spec):
        from pycomm.parallel.pathways.launch import WorkerSpec

        if (spec.island, spec.rank) == self.last:
            time.sleep(self.delay_s)
        extra = self.env.get(f"{spec.island}.{spec.rank}", {})
        return self._local.start(WorkerSpec(spec.island, spec.rank, {**spec.env, **extra}))

    def close(self):
        self._local.close()


def test_start_up_waits_count_from_the_last_launch_not_the_first():
    """The first worker's waits on its peers start once the cluster has started them all:
    a launcher slower than the timeout (Ray on loaded CPUs) still brings the cluster up."""
    launcher = _SlowLastLauncher(last=(1, 1), delay_s=8.0)
    began = time.monotonic()
    with pw.Cluster([2, 2], launcher=launcher, timeout_s=5, env=ENV) as c, \
            c.client(timeout_s=30) as client:
        assert time.monotonic() - began > 8.0
        with pytest.raises(IndexError, match="shard 30 of a future on a mesh of 2"):
            client.call(fns.summed, client.mesh(0, (2,)), torch.ones(8, dtype=F64),
                        out=V8).result(30)
        b = client.mesh(1, (2,))
        y = client.call(fns.summed, b, torch.ones(8, dtype=F64), out=V8)
        torch.testing.assert_close(y.result(0, timeout=30), torch.full((8,), 2.0, dtype=F64))


def test_a_worker_that_fails_its_start_up_is_named_with_its_cause():
    """Whatever the launcher did with the worker's output, the cluster's error says why."""
    launcher = _SlowLastLauncher(last=(0, 0), delay_s=0.0,
                                 env={"1.0": {"PW_THREADS": "0"}})
    with pytest.raises(RuntimeError) as raised:
        pw.Cluster([2, 2], launcher=launcher, timeout_s=30, env=ENV)
    message = str(raised.value)
    assert "island 1 rank 0" in message and "before its island was up" in message, message
    assert "its cause" in message and "set_num_threads expects a positive integer" in message
    assert "exited with status 1 " in message, "a failed start-up exits, it does not abort"




@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_killed_worker_is_named_the_other_island_goes_on_and_the_island_restarts(
        launcher, request):
    started = _launcher(launcher, request, [2, 2])
    with (pw.Cluster([2, 2], launcher=started, timeout_s=30, env=ENV) as c,  # type: ignore[arg-type]
          c.client(timeout_s=60) as client):
        seen = programs.killed_worker(c, client)
        assert f"island 0 rank 1 (pid {seen['pid']}) died" in seen["error"], seen
        assert seen["named_after_s"] < 30
        torch.testing.assert_close(seen["other"], torch.full((8,), 2.0**13, dtype=F64))
        a, b = seen["meshes"]
        x = torch.ones(8, dtype=F64)
        c.restart(0)
        with pytest.raises(pw.PathwaysError, match="lost when the island restarted"):
            client.call(fns.summed, a, x, out=V8)
        a = client.mesh(0, (2,))
        y = client.call(fns.summed, a, x, out=V8)
        z = client.call(fns.plus, b, y, 1.0, out=V8)  # the links to the new island
        torch.testing.assert_close(z.result(1), torch.full((8,), 3.0, dtype=F64))


def test_a_dead_workers_peers_failures_wait_for_the_scheduler_to_name_the_death():
    """A killed worker's peer sees the death in its collective and, its mesh aborted, fails
    every later node at once: those reports may reach the scheduler before the worker's
    closed connection does. They echo the death, so the client is told the death."""
    sched = IslandScheduler(0, 2, b"k")
    told: list[tuple] = []
    try:
        sched._tell = lambda client, message: told.append(message)  # type: ignore[method-assign]
        sched.pids = {0: 40, 1: 41}
        for node in (12, 14):
            sched.in_flight[(0, node)] = _InFlight(0, "spin", {0, 1}, mesh=0)
        sched.load = [2, 2]
        seen = ("island 0 rank 0: spin (node 12 of client 0) raised DistBackendError: "
                f"pycomm: all_reduce (rank 0 of 2, seq 13, {'a long description ' * 30}) "
                "failed: rank 1 (pid 41) died at /x/distributed_c10d.py:3245")
        sched._on_failed(0, 12, 0, seen)
        sched._on_failed(0, 14, 0, "island 0 rank 0: spin (node 14 of client 0) raised "
                         "RuntimeError: mesh 0 of island 0 was aborted after node 12 "
                         f"failed ({worker_quoted(seen)}); ask for a new mesh")
        assert told == [], "the peer's view of a death is held for the scheduler's own word"
        sched._worker_died(1)
        death = "island 0 rank 1 (pid 41) died (its connection to the island's scheduler closed)"
        assert told == [("failed", 12, death), ("failed", 14, death)]
        assert not sched.in_flight
    finally:
        sched.stop()


@pytest.mark.parametrize("last", ["cause", "done", "echo"])
def test_the_scheduler_tells_a_failures_cause_not_the_aborts_echo(last):
    """A rank whose function raised aborts the mesh, and its peer's failure (the abort
    reaching it) may reach the scheduler first: the client is told the cause when a rank
    reports one, the echo only when none does, and never "done" for a node a rank failed."""
    sched = IslandScheduler(0, 2, b"k")
    told: list[tuple] = []
    try:
        sched._tell = lambda client, message: told.append(message)  # type: ignore[method-assign]
        sched.in_flight[(7, 3)] = _InFlight(7, "f", {0, 1}, mesh=5)
        sched.load = [1, 1]
        echo = "rank 0: DistBackendError: pycomm: rank 1 aborted the process group"
        sched._on_failed(7, 3, 0, echo)
        assert told == [], "an echo is held while a rank may still report the cause"
        if last == "cause":
            sched._on_failed(7, 3, 1, "rank 1: ValueError: rank-one refuses")
            assert told == [("failed", 3, "rank 1: ValueError: rank-one refuses")]
        elif last == "done":
            sched._on_done(7, 3, 1, 0.0, 1.0)
            assert told == [("failed", 3, echo)]
        else:
            sched._on_failed(7, 3, 1, echo.replace("rank 1", "rank 0"))
            assert told == [("failed", 3, echo)]
        assert (7, 3) not in sched.in_flight and 5 in sched.broken_meshes
    finally:
        sched.stop()
