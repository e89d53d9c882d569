"""The benchmark's contract, as nccl-tests': a wrong result fails the run (non-zero exit,
"Out of bounds values : N FAILED"), a header with versions and rank placement, JSON with
provenance; its timing modes, its per-op limits, and the summary of fresh jobs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from bench import _jobs, _limit, _summary, _timing
from bench._ports import hosted_store
from bench.collectives import main

TINY = ["-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "1", "--quiet", "--bind", "none"]


@pytest.fixture
def one_rank_in_place(monkeypatch):
    """RANK/WORLD_SIZE set: the benchmark runs this process as its only rank (as under
    torchrun), so a test can patch what a backend does. A rank may pin itself to a CPU
    (--bind): the test process gets its CPUs back afterwards, or every later test (and
    every rank it spawns) would run on one CPU."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    cpus = os.sched_getaffinity(0)
    with hosted_store(1):  # the rank joins it (bench._ports): no port to race for
        yield
    os.sched_setaffinity(0, cpus)


def _corrupting(original):
    def launcher(self, op, bufs, redop):
        run = original(self, op, bufs, redop)

        def wrong() -> None:
            run()
            bufs.result()[:2] += 1  # two elements off on every call
        return wrong
    return launcher


@pytest.mark.parametrize("timing", ["barrier", "b2b"])
def test_a_wrong_result_fails_the_run(one_rank_in_place, monkeypatch, capsys, tmp_path, timing):
    monkeypatch.setattr(_timing.TorchComm, "launcher", _corrupting(_timing.TorchComm.launcher))
    with pytest.raises(SystemExit) as exited:
        main(["--backends", "gloo", "--timing", timing, *TINY, "--out", str(tmp_path / "c.json")])
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert "# Out of bounds values : 4 FAILED" in out  # 2 sizes x 2 elements
    assert json.loads((tmp_path / "c.json").read_text())["meta"]["wrong"] == 4


def test_a_call_that_writes_nothing_is_wrong_when_every_iteration_is_checked(
        one_rank_in_place, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(_timing.TorchComm, "launcher", lambda self, op, bufs, redop: lambda: None)
    with pytest.raises(SystemExit):
        main(["--backends", "gloo", "--ops", "all_gather", "-c", "2", *TINY,
              "--out", str(tmp_path / "c.json")])
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [r["wrong"] for r in rows] == [3 * 256, 3 * 1024]  # every element, every iteration


def test_header_and_json_carry_provenance(one_rank_in_place, capsys, tmp_path):
    cpus = os.sched_getaffinity(0)
    main(["--backends", "gloo", *TINY[:-2], "--out", str(tmp_path / "c.json")])  # --bind auto
    assert os.sched_getaffinity(0) == {min(cpus)}  # the one rank pinned itself
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "# Out of bounds values : 0 OK" in out
    assert "#   rank  0 on " in out and " cpus " in out
    assert "# c2c before: c2c: " in out and "# c2c after:  c2c: " in out
    prov = json.loads((tmp_path / "c.json").read_text())["meta"]["provenance"]
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["placement"][0]["rank"] == 0 and prov["started"] <= prov["finished"]
    assert {"host", "cpu", "commit", "argv", "env", "c2c_before", "c2c_after"} <= set(prov)


def test_the_test_process_has_its_cpus_back():
    """Runs after the in-process runs above (file order): their pinning did not leak."""
    assert len(os.sched_getaffinity(0)) > 1 or os.cpu_count() == 1


def test_back_to_back_and_checked_modes_are_right_on_two_ranks(tmp_path):
    for timing, check in (("b2b", 1), ("barrier", 2)):
        out = tmp_path / f"{timing}.json"
        main(["--backends", "gloo", "--ops", "all_reduce,all_gather,reduce_scatter",
              "--timing", timing, "-c", str(check), *TINY, "--out", str(out)])
        rows = json.loads(out.read_text())["results"]
        assert len(rows) == 6 and all(r["wrong"] == 0 for r in rows), rows


def test_limit_is_the_least_traffic_at_the_measured_rates():
    # all_reduce at 2 ranks: 2 S of its own tensor and S from the other core. S = 1e6 B
    # at 20 GB/s local (100 us) and 5 GB/s handoff (200 us): the handoff rules, busbw 5.
    assert _limit.least_traffic("all_reduce", 1_000_000, 2) == (2_000_000, 1_000_000)
    assert _limit.least_bytes("all_reduce", 1_000_000, 2) == 3_000_000
    assert _limit.limit_busbw("all_reduce", 1_000_000, 2, 20.0, 99.0, 5.0) == pytest.approx(5.0)
    # a fast handoff: the local traffic rules (100 us), busbw 10
    assert _limit.limit_busbw("all_reduce", 1_000_000, 2, 20.0, 99.0, 50.0) == pytest.approx(10.0)
    # 4 ranks on 2 cores share the handoff: twice the time
    assert _limit.limit_busbw("all_reduce", 1_000_000, 2, 20.0, 99.0, 5.0, 2) == pytest.approx(
        2.5)
    # no second CPU (no reading): the exchanged bytes at the cache rate
    assert _limit.limit_busbw("all_reduce", 1_000_000, 2, 20.0, 5.0, None) == pytest.approx(5.0)


def test_ranks_sharing_a_core_share_its_rate_in_the_limit():
    """Two ranks per core: the core does both ranks' bytes, at best at one core's rate
    alone, even when each rank's timed pass (run one after the other) showed that rate."""
    touched = 2_000_000
    assert _limit.tensor_seconds(touched, 20.0) == pytest.approx(100e-6)
    # each rank timed 20 GB/s, a core alone does 25: the pair needs 2 x 2 MB at 25
    assert _limit.tensor_seconds(touched, 20.0, 2, 25.0) == pytest.approx(160e-6)
    # each rank's pass already shared the core (10 GB/s): that reading rules
    assert _limit.tensor_seconds(touched, 10.0, 2, 25.0) == pytest.approx(200e-6)
    # one rank per core, or no one-core reading: the per-rank rate
    assert _limit.tensor_seconds(touched, 20.0, 1, 25.0) == pytest.approx(100e-6)
    assert _limit.tensor_seconds(touched, 20.0, 2, None) == pytest.approx(100e-6)
    # arena tensors (read in place) at 4 ranks on 2 cores: 2 S per rank, two ranks a core
    run = {"local_gbs": {"1000000": 20.0}, "cache_gbs": 20.0, "handoff_gbs": 100.0,
           "ranks_per_core": 2, "local_gbs_one_core": {"1000000": 25.0}}
    got = _limit.limits_of_run(run, [("all_reduce", 1_000_000)], 4, staged=False)
    assert got[("all_reduce", 1_000_000)] == pytest.approx(1e6 / 160e-6 / 1e9 * 1.5)


def test_a_summary_recomputes_the_limit_from_the_raw_rates():
    limit = {"local_gbs": {"1048576": 20.0, "4194304": 10.0}, "cache_gbs": 20.0,
             "handoff_gbs": 50.0, "ranks_per_core": 1}
    got = _limit.limits_of_run(limit, [("all_reduce", 1 << 20), ("all_gather", 4194300)], 2)
    assert got[("all_reduce", 1 << 20)] == pytest.approx(10.0)  # 2 S at 20 GB/s
    # 4194300 B (rounded down from 4 MiB) takes the 4 MiB rate: (S/2 + S) at 10 GB/s
    assert got[("all_gather", 4194300)] == pytest.approx(10.0 / 1.5 * 0.5)


def _doc(times: dict[str, float], backends: list[str], wrong: int = 0) -> dict:
    rows = [{"op": "all_reduce", "backend": b, "bytes": 1024, "time_us": t}
            for b, t in times.items()]
    return {"meta": {"backends": backends, "nproc": 2, "datatype": "float32", "iters": 5,
                     "wrong": wrong, "provenance": {"c2c_before": None, "c2c_after": None}},
            "results": rows, "memcpy": {}}


def test_jobs_summary_takes_medians_of_in_job_ratios_and_the_best_mpi():
    jobs = []
    for pycomm, mpi, nocma in ((2.0, 4.0, 3.0), (3.0, 4.0, 6.0), (4.0, 4.0, 2.0)):
        main_run = _doc({"pycomm": pycomm, "mpi": mpi}, ["pycomm", "mpi"])
        tuned = _summary.load_doc(_doc({"pycomm": pycomm * 2, "mpi": nocma}, ["pycomm", "mpi"]),
                                ".nocma")
        jobs.append([main_run, tuned])
    s = _summary.summarize(jobs)
    assert s["time_us"]["all_reduce|pycomm|1024"][:3] == [3.0, 2.0, 4.0]  # main runs only
    assert s["ratio"]["all_reduce|mpi|1024"][:3] == [0.75, 0.5, 1.0]
    # best per job: nocma 3.0 (ratio 4/3), mpi 4.0 (ratio 0.75), nocma 2.0 (ratio 4.0)
    assert s["time_us"]["all_reduce|mpi-best|1024"][:3] == [3.0, 2.0, 4.0]
    assert s["ratio"]["all_reduce|mpi-best|1024"][:3] == [pytest.approx(4 / 3), 0.75, 4.0]
    lines = _jobs.format_summary(s)
    assert lines[-1] == "# Out of bounds values : 0 OK"
    assert s["backends"] == ["pycomm", "mpi", "mpi-nocma", "mpi-best"]


def test_a_table_is_not_dirty_from_the_results_a_benchmark_wrote(tmp_path):
    """bench/run_tables.sh writes each table's results (and the READMEs) into the checkout
    before the next table runs: those must not mark the next one's commit '+dirty';
    a changed source file must, an investigation's among them (records/investigations/)."""
    from bench import _provenance

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for path in ("records/collectives/t.json", "README.md", "csrc/a.cc",
                 "records/investigations/i.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("0\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = _provenance.git_commit(tmp_path)
    assert clean and not clean.endswith("+dirty")
    (tmp_path / "records/collectives/t.json").write_text("1\n")
    (tmp_path / "README.md").write_text("1\n")
    assert _provenance.git_commit(tmp_path) == clean
    (tmp_path / "records/investigations/i.py").write_text("1\n")
    assert _provenance.git_commit(tmp_path) == clean + "+dirty"
    (tmp_path / "records/investigations/i.py").write_text("0\n")
    assert _provenance.git_commit(tmp_path) == clean
    (tmp_path / "csrc/a.cc").write_text("1\n")
    assert _provenance.git_commit(tmp_path) == clean + "+dirty"
