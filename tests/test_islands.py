"""Islands: groups spanning several (simulated) hosts, shared memory inside, gloo between.

One RankPool per layout (2 x 2 and 3 + 1 on 4 ranks, 3 x 2 on 6), with
``PYCOMM_LOCAL_SIZE`` making every N consecutive ranks a host. The numerics reuse
test_collectives' cases (float64 reference, exact for integers); traffic is measured
as the bytes each rank writes to its sockets (/proc/self/io), against the theory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import _islands_scenarios as sc
import pytest
import test_collectives as tc

from pycomm.testing import RankFailure, RankPool, run_ranks
from tests._netns import in_namespace, netns_unavailable, two_hosts

pytestmark = pytest.mark.usefixtures("require_pycomm")

LAYOUTS = {  # name -> (world size, PYCOMM_LOCAL_SIZE, islands)
    "2x2": (4, 2, [[0, 1], [2, 3]]),
    "3+1": (4, 3, [[0, 1, 2], [3]]),
    "3x2": (6, 2, [[0, 1], [2, 3], [4, 5]]),
}
FAIL_TIMEOUT_S = 5.0


@pytest.fixture(scope="module", params=sorted(LAYOUTS), ids=lambda name: name)
def pool(request):
    world, local, _ = LAYOUTS[request.param]
    with RankPool(world, env={"PYCOMM_LOCAL_SIZE": str(local)}, pg_timeout_s=30.0) as p:
        p.layout = request.param
        yield p


def run_same(pool: RankPool, fn, *args) -> list:
    results = pool.run(fn, *args)
    assert all(r == results[0] for r in results), f"ranks disagree: {results}"
    return results


def test_layout(pool):
    islands = LAYOUTS[pool.layout][2]
    got = pool.run(sc.layout)
    for rank, (kind, members, island, local_rank) in enumerate(got):
        assert kind == "ProcessGroupIslands" and members == islands
        assert rank == members[island][local_rank]


def test_all_reduce_every_dtype_and_op(pool):
    run_same(pool, sc.all_reduce_everything)


def test_reduce_scatter(pool):
    pool.run(sc.reduce_scatter_everything, pool.layout == "3x2")


def test_data_movement(pool):
    pool.run(sc.data_movement_everything)


def test_send_recv_and_barrier(pool):
    pool.run(sc.send_recv_everything)
    tc.barrier_waited_for_rank_0(pool.run(sc.barrier_waits))


def test_ddp_matches_gloo(pool):
    assert max(pool.run(sc.ddp_matches_gloo)) < 1e-6


def test_bad_input_is_refused_at_once(pool):
    for messages in pool.run(sc.bad_input):
        assert all(messages), messages
        assert "AVG" in messages[0] and "int32" in messages[0]
        assert "ComplexFloat" in messages[1]
        assert "all_gather_into_tensor" in messages[2] and "reduce_scatter" in messages[3]
        assert "meta" in messages[4]


def test_inter_island_traffic_matches_theory(pool):
    """Per all_reduce of N bytes: a rank hands its shard (N / L) to gloo, and a ring of
    I islands sends 2 (I - 1) / I of that; a flat gloo ring of W sends 2 (W - 1) / W of N."""
    world, local, islands = LAYOUTS[pool.layout]
    numel = 1 << 20
    nbytes = 4 * numel
    n_islands = len(islands)
    for rank, got in enumerate(pool.run(sc.traffic, numel)):
        flat = 2 * (world - 1) / world * nbytes
        assert got["gloo_written"] == pytest.approx(flat, rel=0.01)
        # unequal islands (3 + 1): the leaders (ranks 0 and 3) carry the whole message
        leaders_only = nbytes if rank in (0, 3) else 0
        handed = leaders_only if pool.layout == "3+1" else nbytes // local
        assert got["counter"] == handed
        assert got["islands_written"] == pytest.approx(2 * (n_islands - 1) / n_islands * handed,
                                                       rel=0.01, abs=4096)


def test_debug_info_names_the_path(pool):
    for text in pool.run(sc.debug_log):
        assert "islands:" in text and "between islands" in text, text
        assert "all_reduce seq 1: 1000 elements by" in text, text
        want = "by leaders" if pool.layout == "3+1" else "by shards"
        assert want in text and "broadcast" in text, text


# --- a rank killed: every rank of every island names it -------------------------------


@pytest.mark.parametrize(("layout", "victim"), [("2x2", 3), ("3+1", 3), ("3+1", 1)])
def test_killed_rank_is_named_everywhere(layout, victim):
    world, local, _ = LAYOUTS[layout]
    with pytest.raises(RankFailure) as info:
        run_ranks(sc.killed_rank, world, victim, FAIL_TIMEOUT_S, pg_timeout_s=FAIL_TIMEOUT_S,
                  env={"PYCOMM_LOCAL_SIZE": str(local)}, timeout_s=60.0)
    failures = info.value.failures
    assert set(failures) == {victim}, f"only the victim may fail:\n{info.value}"
    assert failures[victim].kind == "died"


# --- real hosts: two network namespaces --------------------------------------------------

NETNS_SCRIPT = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist
    import pycomm
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("pycomm", init_method=f"tcp://{sys.argv[3]}:{sys.argv[4]}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    ok = torch.equal(t, torch.arange(1000, dtype=torch.float64) * sum(range(1, world + 1)))
    print(type(b).__name__, b.islands, ok, flush=True)
    dist.destroy_process_group()
""")


def test_two_hosts_in_network_namespaces(tmp_path: Path):
    """Two namespaces joined by a veth pair (10.77.0.1/2, nothing routed): two hosts."""
    if reason := netns_unavailable():
        pytest.skip(reason)
    script = tmp_path / "rank.py"
    script.write_text(NETNS_SCRIPT)
    with two_hosts("islands") as ns:
        env = {"GLOO_SOCKET_IFNAME": "pcveth0", "PATH": "/usr/bin:/bin",
               "PYTHONPATH": str(Path(__file__).parent.parent)}
        procs = [subprocess.Popen(in_namespace(ns[rank // 2], env, [
                                      sys.executable, str(script), str(rank), "4", "10.77.0.1",
                                      "29517"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank in range(4)]
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}:\n{out}"
        assert "ProcessGroupIslands [[0, 1], [2, 3]] True" in out, f"rank {rank}:\n{out}"
