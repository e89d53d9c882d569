"""pycomm.parallel.ps: the parameter server's pieces alone (messages, ring, rows, consistency
gates), then real jobs (``python -m pycomm.parallel.ps.launch``: a scheduler, server processes
and worker processes over ZeroMQ) checked against one process applying the same pushes
with the same update rule: synchronous training, a server killed, a server added, a
worker killed, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pycomm.parallel.ps import wire
from pycomm.parallel.ps.consistency import Gate, VectorClock
from pycomm.parallel.ps.ring import Ring
from pycomm.parallel.ps.store import Table, TableSpec

ROOT = Path(__file__).resolve().parent.parent

# --- pieces ---------------------------------------------------------------------------------


def test_messages_round_trip_and_refuse_what_the_header_does_not_say():
    keys, vals = torch.tensor([1, 5, 9]), torch.randn(3, 4)
    header, (k, v) = wire.unpack([bytes(f) for f in wire.pack({"op": "push"}, [keys, vals])])
    assert header["op"] == "push" and torch.equal(k, keys) and torch.equal(v, vals)
    frames = [bytes(f) for f in wire.pack({"op": "push"}, [keys, vals])]
    with pytest.raises(wire.WireError, match=r"tensor 1 \(float32 \[3, 4\]\): frame holds 40"):
        wire.unpack([frames[0], frames[1], frames[2][:40]])
    with pytest.raises(wire.WireError, match="lists 2 tensors, message has 1"):
        wire.unpack(frames[:2])
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.unpack([b"\xff{", frames[1]])
    bad = json.dumps({"op": "push", "tensors": [["float128", [1]]]}).encode()
    with pytest.raises(wire.WireError, match="bad spec"):
        wire.unpack([bad, b"x" * 16])


def test_ring_spreads_keys_and_moves_few_when_a_server_joins():
    keys = torch.arange(20_000, dtype=torch.int64)
    three, four = Ring([0, 1, 2], replicas=1), Ring([0, 1, 2, 3], replicas=1)
    share = torch.bincount(three.primary("t", keys), minlength=3).float() / len(keys)
    assert float(share.min()) > 0.2, share  # 64 virtual nodes each: roughly a third each
    moved = (three.primary("t", keys) != four.primary("t", keys)).float().mean()
    assert 0.1 < float(moved) < 0.4, moved  # ~1/4 of the keys, all of them to server 3
    assert bool((four.primary("t", keys)[three.primary("t", keys) != four.primary("t", keys)]
                 == 3).all())
    holders = three.holders("t", keys)
    assert bool((holders[:, 0] != holders[:, 1]).all())  # a replica is another server


def test_rows_insert_find_drop_and_remember_each_workers_last_push():
    t = Table(TableSpec("t", 2, {"name": "sgd", "lr": 1.0}, "zeros"), workers=2)
    rows = t.rows_for(torch.tensor([3, 9]), create=True)
    t.update(rows, torch.ones(2, 2))
    t.record(rows, worker=1, seq=5)
    assert t.rows_for(torch.tensor([1, 3, 9]), create=True).tolist() == [0, 1, 2]
    assert t.keys.tolist() == [1, 3, 9]  # kept sorted by an insert
    rows = t.rows_for(torch.tensor([3, 9]), create=False)
    assert t.values[rows].tolist() == [[-1.0, -1.0]] * 2
    assert t.fresh_rows(rows, 1, 5).tolist() == [False, False]  # a resent push: skipped
    assert t.fresh_rows(rows, 0, 5).tolist() == [True, True]
    strict = Table(TableSpec("s", 2, {"name": "sgd"}, "none"), workers=1)
    with pytest.raises(KeyError, match="never pushed or set"):
        strict.rows_for(torch.tensor([4]), create=False)


@pytest.mark.parametrize(("mode", "tau", "answers"), [
    ("bsp", 0, [True, True, False]), ("ssp", 1, [True, True, True]), ("async", 0, [True] * 3)])
def test_gate_answers_pulls_by_the_slowest_workers_clock(mode, tau, answers):
    vc = VectorClock(2)
    vc.advance(0, 3)
    vc.advance(1, 1)  # worker 1 has finished 1 step, worker 0 three
    assert [Gate(mode, tau).may_answer(c, vc) for c in (0, 1, 2)] == answers
    vc.live = {0}  # worker 1 died: only the living count
    assert Gate(mode, tau).may_answer(3, vc)


def test_a_request_that_comes_before_the_servers_own_start_is_answered_after_it(tmp_path):
    """The scheduler's start reaches a worker and a server on separate connections: a
    worker may ask before the server knows the ring. Before: that declare was held until
    a ring change that never came, and the job hung (seen once in CI: "no answer from
    server(s) in 60 s")."""
    from pycomm.parallel.ps.config import JobConfig
    from pycomm.parallel.ps.server import Server

    server = Server(JobConfig(f"ipc://{tmp_path}/sched", 1, 1), "tcp://127.0.0.1:*")
    replies: list[dict] = []
    server._reply = lambda who, header, tensors=(): replies.append(header)  # type: ignore
    spec = {"name": "t", "dim": 2, "updater": {"name": "sgd", "lr": 0.1}, "init": "zeros"}
    ring = Ring([0], replicas=0)
    try:
        server._from_router([b"w0", *(bytes(f) for f in wire.pack(
            {"op": "declare", "table": spec, "id": 7, "epoch": 0}))])
        assert replies == []  # held: this server has no ring yet
        server._from_scheduler([bytes(f) for f in wire.pack(
            {"op": "start", "sid": 0, "ring": ring.spec(), "epoch": 0,
             "endpoints": {"0": server.endpoint}})])
        assert [(r["op"], r["id"]) for r in replies] == [("ok", 7)], replies
        assert "t" in server.tables
    finally:
        if server.heartbeat is not None:
            server.heartbeat.stop()
        for sock in (server.router, server.sched):
            sock.close(linger=0)
        server.ctx.term()


# --- jobs -----------------------------------------------------------------------------------


# Deaths in these jobs are of processes the launcher started: it sees them exit at once
# (tests assert the event says "by": "exit"), so heartbeats matter only to the test of a
# silent process, and a long timeout keeps an oversubscribed machine's late heartbeats
# from killing a live one. A death the exit did not reveal shows as "by": "heartbeat".
HEARTBEAT_TIMEOUT_S = "30"


def job(tmp_path: Path, scenario: str, arg: str = "", servers: int = 2, workers: int = 2,
        replicas: int = 0, restore: str = "", *flags: str
        ) -> tuple[list[dict], subprocess.CompletedProcess[str]]:
    out = tmp_path / scenario
    out.mkdir()
    cmd = [sys.executable, "-m", "pycomm.parallel.ps.launch", "--servers", str(servers),
           "--workers", str(workers), "--replicas", str(replicas),
           "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S,
           *(["--restore", restore] if restore else []), *flags,
           "--timeout", "60", "--", sys.executable, str(ROOT / "tests" / "_ps_jobs.py"),
           scenario, str(out), arg]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return results, done


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_bsp_equals_one_process(tmp_path, rule):
    results, done = job(tmp_path, "bsp", rule)
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    assert results[0]["diff"] <= 1e-5, results[0]
    assert results[0]["applied"] == sum(r["sent"] for r in results)


@pytest.mark.parametrize(("servers", "replicas", "victim"), [(3, 1, 1), (4, 2, 2)])
def test_a_killed_server_loses_nothing(tmp_path, servers, replicas, victim):
    """SIGKILL one server mid-run (each range on a chain of 1 + R servers; with R = 2 the
    victim is the head, middle or tail of some chain): the job finishes with the model of
    a run without the kill, and every push sent was applied once."""
    results, done = job(tmp_path, "kill_server", str(victim), servers=servers,
                        replicas=replicas)
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    events = results[0]["events"]
    assert [e["event"] for e in events] == ["server_dead", "ring"], events
    assert events[0]["server"] == victim and events[0]["by"] == "exit", events
    assert results[0]["servers"] == [s for s in range(servers) if s != victim]
    assert results[0]["diff"] <= 1e-5, results[0]
    assert results[0]["applied"] == sum(r["sent"] for r in results)


def test_a_silent_server_is_found_dead_by_its_heartbeats(tmp_path):
    """SIGSTOP one server mid-run: its process lives on, so only the heartbeats can tell
    (timeout 1.5 s; the deadline grows with the longest gap seen between any node's
    heartbeats, so late ones on a loaded machine do not kill a live node). The job
    finishes without it, as after a kill."""
    results, done = job(tmp_path, "stop_server", "1", 3, 2, 1, "", "--heartbeat-timeout", "1.5")
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    events = results[0]["events"]
    assert [e["event"] for e in events] == ["server_dead", "ring"], events
    assert events[0]["server"] == 1 and events[0]["by"] == "heartbeat", events
    assert events[0]["silent_s"] >= 1.5, events
    assert results[0]["diff"] <= 1e-5, results[0]
    assert results[0]["applied"] == sum(r["sent"] for r in results)


def test_a_server_added_mid_run_takes_ranges_over(tmp_path):
    results, done = job(tmp_path, "add_server", servers=2, replicas=1)
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    assert results[0]["servers"] == [0, 1, 2]
    assert results[0]["diff"] <= 1e-5 and results[0]["applied"] == sum(r["sent"] for r in results)


def test_a_killed_worker_is_named_and_the_others_finish(tmp_path):
    results, done = job(tmp_path, "kill_worker")
    assert len(results) == 1, done.stderr[-3000:]  # worker 1 died at step 3
    assert results[0]["dead"] == [1] and "worker_dead: {'worker': 1" in done.stderr
    assert "'by': 'exit'" in done.stderr, done.stderr[-3000:]  # not the heartbeats (30 s)
    assert results[0]["diff"] <= 1e-5, results[0]  # BSP went on with the live worker


def test_a_script_that_ends_without_close_has_finished(tmp_path):
    """Before: each worker was reported dead ("by": "heartbeat") once its process had gone;
    the interpreter's exit now closes it."""
    results, done = job(tmp_path, "no_close")
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    assert "worker_dead" not in done.stderr, done.stderr[-3000:]
    assert results[0]["diff"] <= 1e-5, results[0]


def test_a_worker_that_exits_0_without_close_is_named_by_its_exit(tmp_path):
    """os._exit(0) skips the interpreter's exit: the launcher sees the process end before
    it was done, at once, not after the heartbeats' deadline (30 s here)."""
    results, done = job(tmp_path, "exit0")
    assert len(results) == 2, done.stderr[-3000:]
    assert "worker_dead: {'worker': 1" in done.stderr, done.stderr[-3000:]
    assert "'by': 'exit', 'code': 0" in done.stderr, done.stderr[-3000:]
    assert "worker_dead: {'worker': 0" not in done.stderr, done.stderr[-3000:]


def test_a_checkpoint_restarts_the_job_on_another_number_of_servers(tmp_path):
    """Saved by 3 servers after step 4, restored on 2: steps 5.. continue, and the final
    model is the uninterrupted run's."""
    ckpt = str(tmp_path / "ckpt")
    results, done = job(tmp_path, "checkpoint", ckpt, servers=3)
    assert done.returncode == 0 and results[0]["clock"] == 6, done.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["job.pt", "server0.pt", "server1.pt", "server2.pt"]
    results, done = job(tmp_path, "restored", servers=2, restore=ckpt)
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    assert results[0]["start"] == 4
    assert results[0]["diff"] <= 1e-5, results[0]


def test_a_dead_worker_can_be_replaced_under_bsp(tmp_path):
    """--on-worker-death wait: worker 1 dies mid-step (part of a push sent); its
    replacement redoes that step while worker 0 waits; the model equals a run where
    no one died. Heartbeats time out only after 30 s here: the death must be known from
    the process's exit, before its replacement registers (else the replacement is
    refused as a taken rank, and replaced again)."""
    results, done = job(tmp_path, "replaced_worker", "", 2, 2, 0, "", "--on-worker-death",
                        "wait")
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    events = [e["event"] for e in results[0]["events"]]
    assert events == ["worker_dead", "worker_replaced"], events
    assert results[0]["events"][0]["by"] == "exit", results[0]["events"]
    assert results[1]["incarnation"] == "1" and results[1]["start"] == 4, results[1]
    assert results[0]["diff"] <= 1e-5, results[0]


def test_bad_input_gets_a_clear_error(tmp_path):
    results, done = job(tmp_path, "bad_input", workers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = results[0]["errors"]
    expect = {"unsorted": "unsorted at index 1 (5 then 2)",
              "duplicate": "duplicate at index 1 (2 then 2)",
              "length": "2 keys x dim 3 = 6 values expected, got 5",
              "dtype": "keys must be a 1-D int64 tensor, got torch.float32",
              "undeclared": "table 'nope' was not declared",
              "never_set": "never pushed or set, e.g. [",  # each server names its keys
              "redeclared": "was declared as"}
    for case, text in expect.items():
        assert text in errors[case], (case, errors[case])


def test_a_scheduler_that_does_not_answer_is_named():
    from pycomm.parallel.ps import KVWorker, PSError
    from pycomm.parallel.ps.config import JobConfig

    cfg = JobConfig("tcp://127.0.0.1:9", 1, 1, timeout_s=1.0)
    with pytest.raises(PSError, match=r"no answer from the scheduler at tcp://127.0.0.1:9"):
        KVWorker(rank=0, cfg=cfg)


@pytest.mark.parametrize("answer_after_s", [0.4, None])
def test_a_worker_closes_once_the_scheduler_has_counted_it_done(tmp_path, monkeypatch,
                                                                answer_after_s):
    """close() returns after the scheduler's answer to "done" (before: a 50 ms sleep, so
    a slow scheduler could see the process exit first and end the job as failed), and
    after DONE_ACK_S when no answer comes (the scheduler is gone)."""
    import threading
    import time

    import zmq

    from pycomm.parallel.ps import KVWorker, worker
    from pycomm.parallel.ps.config import JobConfig
    from pycomm.parallel.ps.node import send

    monkeypatch.setattr(worker, "DONE_ACK_S", 1.5)
    ctx = zmq.Context()
    sched = ctx.socket(zmq.ROUTER)
    sched.bind(f"ipc://{tmp_path}/sched")
    got: list[dict] = []

    def fake_scheduler() -> None:  # start the worker; answer its done (or not)
        while True:
            frames = sched.recv_multipart()
            header, _ = wire.unpack(frames[1:])
            got.append(header)
            if header["op"] == "register":
                send(sched, {"op": "start", "ring": Ring([0], replicas=0).spec(), "epoch": 0,
                             "endpoints": {"0": f"ipc://{tmp_path}/server0"}}, to=frames[0])
            elif header["op"] == "done":
                if answer_after_s is not None:
                    time.sleep(answer_after_s)
                    send(sched, {"op": "done", "id": header["id"]}, to=frames[0])
                return

    thread = threading.Thread(target=fake_scheduler, daemon=True)
    thread.start()
    try:
        kv = KVWorker(rank=0, cfg=JobConfig(f"ipc://{tmp_path}/sched", 1, 1, timeout_s=10))
        start = time.monotonic()
        kv.close()
        took = time.monotonic() - start
        thread.join(5)
        assert [h["op"] for h in got if h["op"] != "heartbeat"] == ["register", "done"]
        if answer_after_s is None:
            assert 1.5 <= took < 3.5, took
        else:
            assert answer_after_s <= took < 1.5, took
    finally:
        sched.close(linger=0)
        ctx.term()


def test_a_worker_failing_before_the_start_ends_the_job(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys\nif os.environ['PS_RANK'] == '1':\n    sys.exit(3)\n"
                      "from pycomm.parallel.ps import KVWorker\nKVWorker()\n")
    done = subprocess.run([sys.executable, "-m", "pycomm.parallel.ps.launch", "--workers", "2",
                           "--", sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "worker exit codes [" in done.stderr and "before every process registered" in done.stderr


def _example(tmp_path: Path, name: str, *flags: str) -> list[dict]:
    """The example's metrics lines (written into a folder that does not exist yet, as
    ``runs/`` on a fresh checkout); with ``--check`` it also prints the check."""
    metrics = tmp_path / "runs" / f"{name}.jsonl"
    done = subprocess.run([sys.executable, "-m", f"pycomm.parallel.ps.examples.{name}", *flags,
                           "--metrics", str(metrics)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    if "--check" in flags:
        assert "check: " in done.stdout and "against one process" in done.stdout, done.stdout
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_logistic_regression_under_bsp_equals_one_process(tmp_path):
    lines = _example(tmp_path, "logreg", "--workers", "2", "--steps", "12", "--features",
                     "10000", "--density", "0.01", "--check", "--codec", "none")
    steps = [r for r in lines if "step" in r]
    assert sorted({r["worker"] for r in steps}) == [0, 1] and len(steps) == 24
    assert set(steps[0]) >= {"step", "loss", "worker", "clock", "pushed_bytes", "pulled_bytes"}
    check = next(r for r in lines if "check_diff" in r)
    assert check["check_diff"] <= 1e-5 * check["check_scale"], check


def test_the_gpt_under_bsp_equals_one_process(tmp_path):
    lines = _example(tmp_path, "dense", "--workers", "2", "--steps", "3", "--n-layer", "1",
                     "--n-embd", "32", "--block-size", "16", "--check")
    check = next(r for r in lines if "check_diff" in r)
    assert check["check_diff"] <= 1e-5, check


def test_two_hosts_one_server_each(tmp_path):
    """The scheduler, a server and worker 0 in one network namespace, a server and worker
    1 in the other, over TCP across the veth pair: BSP still equals one process."""
    from tests._netns import in_namespace, netns_unavailable, two_hosts

    if reason := netns_unavailable():
        pytest.skip(reason)
    out = tmp_path / "out"
    out.mkdir()
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PS_SCHEDULER": "10.77.0.1:29611", "PS_NUM_SERVERS": "2", "PS_NUM_WORKERS": "2",
            "PS_TIMEOUT_S": "60"}
    role = [sys.executable, "-m", "pycomm.parallel.ps.launch", "--role-from-env"]
    work = [sys.executable, str(ROOT / "tests" / "_ps_jobs.py"), "bsp", str(out), "sgd"]
    with two_hosts("ps") as (a, b):
        procs = [subprocess.Popen(in_namespace(ns, {**base, **env}, argv), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for ns, env, argv in [
                     (a, {"PS_ROLE": "scheduler"}, role),
                     (a, {"PS_ROLE": "server", "PS_BIND": "tcp://10.77.0.1:*"}, role),
                     (b, {"PS_ROLE": "server", "PS_BIND": "tcp://10.77.0.2:*"}, role),
                     (a, {"PS_ROLE": "worker", "PS_RANK": "0"}, work),
                     (b, {"PS_ROLE": "worker", "PS_RANK": "1"}, work)]]
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, text in zip(procs, outs, strict=True):
        assert p.returncode == 0, text[-2000:]
    result = json.loads((out / "rank0.json").read_text())
    assert result["diff"] <= 1e-5 and result["servers"] == [0, 1], result
