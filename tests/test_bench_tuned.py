"""Every peer at its best (--tuned), under competing load (--load), and the limit model."""

import json
import os

import pytest

from bench import _best, _gloo, _limit, _load, _stripes
from bench.collectives import main

TINY = ["-b", "1K", "-e", "16K", "-f", "16", "-n", "2", "-w", "1", "--quiet"]


def _row(backend, t, op="all_reduce", n=1024):
    return {"op": op, "backend": backend, "bytes": n, "time_us": t}


def _job(rows_by_run):
    return [{"meta": {"nproc": 2}, "results": rows} for rows in rows_by_run]


def test_families_take_every_setting_of_a_backend():
    assert _best.family("gloo-1t@unpinned") == "gloo"
    assert _best.family("mpi-nocma") == "mpi"
    assert _best.family("deepspeed-api") == "deepspeed"
    assert _best.family("pycomm-api@unpinned") == "pycomm-api"
    assert _best.family("pycomm#2@unpinned") == "pycomm#2"
    assert _best.family("pycomm-api+stripes4@unpinned") == "pycomm-api"
    assert _best.family("pycomm+stripes4") == "pycomm"
    assert _best.family("torch-floor") == "torch-floor"


def test_best_of_a_job_and_the_best_peer_name_what_won():
    job = _job([[_row("pycomm", 4.0), _row("gloo", 300.0), _row("mpi", 3.0)],
                [_row("pycomm@unpinned", 5.0), _row("gloo-1t@unpinned", 200.0),
                 _row("mpi-nocma@unpinned", 2.0), _row("torch-floor", 0.5)]])
    best = _best.best_of_job(job)
    assert best[("all_reduce", "gloo", 1024)] == (200.0, "gloo-1t@unpinned")
    assert best[("all_reduce", "pycomm", 1024)] == (4.0, "pycomm")
    assert ("all_reduce", "torch-floor", 1024) not in best  # a floor, not a peer
    assert _best.best_peer(best, "all_reduce", 1024) == (2.0, "mpi-nocma@unpinned")
    s = _best.summarize([job, job, job], "pycomm")
    assert s["vs_best_peer"]["all_reduce|pycomm|1024"][:3] == [2.0, 2.0, 2.0]
    assert s["best_peer_won_by"]["all_reduce|1024"] == {"mpi-nocma@unpinned": 3}


def test_a_striped_twin_counts_only_where_it_stripes():
    # Below PYCOMM_STRIPE_BYTES the twin runs the plain column's code: a second sample of
    # one setting must not make pycomm's best a best of more draws than the setting has.
    small, large = 1 << 20, _stripes.STRIPE_BYTES
    job = _job([[_row("pycomm-api", 10.0, n=small), _row("pycomm-api+stripes4", 9.0, n=small),
                 _row("pycomm-api", 900.0, n=large),
                 _row("pycomm-api+stripes4", 300.0, n=large)]])
    best = _best.best_of_job(job)
    assert best[("all_reduce", "pycomm-api", small)] == (10.0, "pycomm-api")
    assert best[("all_reduce", "pycomm-api", large)] == (300.0, "pycomm-api+stripes4")
    assert _stripes.with_striped_twins(["pycomm", "gloo", "pycomm-api"]) == [
        "pycomm", "pycomm+stripes4", "pycomm+stripes8", "gloo", "pycomm-api",
        "pycomm-api+stripes4", "pycomm-api+stripes8"]


def test_competing_load_runs_pinned_and_is_gone_after():
    with _load.competing(1, "mem") as pids:
        assert len(pids) == len(os.sched_getaffinity(0))
        for pid in pids:
            assert len(os.sched_getaffinity(pid)) == 1  # pinned to its CPU
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="load kind"), _load.competing(1, "disk"):
        pass


def test_tuned_loaded_run_times_every_setting_and_keeps_its_raw_files(tmp_path):
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit) as done:
        main(["--backends", "pycomm,gloo", "--ops", "all_reduce,all_gather", "--tuned",
              "--load", "1", "--load-kind", "cpu", *TINY, "--out", str(out)])
    assert done.value.code == 0
    s = json.loads(out.read_text())
    assert s["load"] == {"per_cpu": 1, "kind": "cpu"} and s["wrong"] == 0
    [names] = s["runs"]
    assert names == ["s.job1.json", "s.job1@unpinned.json"]
    labels = set()
    for name in names:
        raw = json.loads((tmp_path / name).read_text())
        assert raw["meta"]["wrong"] == 0 and raw["meta"]["load"]["per_cpu"] == 1
        labels |= set(raw["meta"]["backends"])
    assert labels == {f"{b}{pin}" for b in ("pycomm", "pycomm+stripes4", "pycomm+stripes8", "gloo",
                                            *_gloo.VARIANTS)
                      for pin in ("", "@unpinned")}
    for key, counts in s["best"]["best_won_by"].items():
        assert set(counts) <= labels and sum(counts.values()) == 1, key
    assert set(s["best"]["limit_fraction"]) == {f"{op}|{n}" for op in ("all_reduce", "all_gather")
                                               for n in (1024, 16384)}


def test_over_floor_is_what_a_backend_adds_to_torch_in_the_same_run():
    job = _job([[_row("pycomm", 6.0), _row("torch-floor", 4.5)],
                [_row("pycomm@unpinned", 5.0), _row("torch-floor@unpinned", 4.5)]])
    assert _best.over_floor(job, "pycomm") == {("all_reduce", 1024): 0.5}
    assert _best.summarize([job] * 3, "pycomm")["over_floor_us"]["all_reduce|1024"][:3] == [
        0.5, 0.5, 0.5]


def _limit_at(local_gbs):
    """A run's measured rates: 1 MB rmw at ``local_gbs``, no core-to-core reading."""
    return {"local_gbs": {str(1 << 20): local_gbs}, "cache_gbs": local_gbs}


def test_same_run_fraction_pairs_each_time_with_its_own_runs_limit():
    """The job's fraction takes its best time over its best limit, which may come from
    different runs (the machine's state moves); the same-run fraction divides each run's
    time by that run's limit and keeps every run, not the best one."""
    n = 1 << 20
    job = _job([[_row("pycomm", 100.0, n=n)], [_row("pycomm@unpinned", 200.0, n=n)]])
    job[0]["limit"], job[1]["limit"] = _limit_at(40.0), _limit_at(10.0)
    s = _best.summarize([job], "pycomm")
    limit_40 = _limit.limit_busbw("all_reduce", n, 2, 40.0, 40.0, None)
    limit_10 = _limit.limit_busbw("all_reduce", n, 2, 10.0, 10.0, None)
    busbw = {t: n / (t * 1e-6) / 1e9 for t in (100.0, 200.0)}
    [job_fraction] = [s["limit_fraction"][f"all_reduce|{n}"][0]]
    assert job_fraction == pytest.approx(busbw[100.0] / limit_40)
    same = s["limit_fraction_same_run"][f"all_reduce|{n}"]
    assert same[1:] == pytest.approx([busbw[100.0] / limit_40, busbw[200.0] / limit_10, 2])


def test_every_pycomm_family_has_its_fraction_of_the_limit_and_its_column():
    """pycomm on arena tensors (pycomm-registered) is measured against the in-place limit
    (peers read its buffers where they are: nothing staged, nothing handed between
    cores), ordinary tensors against the staged one, and the table shows both limits and
    each fraction; peers, the A/A column and the floor get none (they are not pycomm's
    settings)."""
    from bench import tables

    n = 1 << 20
    rows = [_row("pycomm", 200.0, n=n), _row("pycomm-registered", 100.0, n=n),
            _row("pycomm#2", 210.0, n=n), _row("gloo", 900.0, n=n)]
    job = _job([rows, [dict(r, backend=r["backend"] + "@unpinned") for r in rows]])
    for doc in job:
        # The handoff is the slower rate, so the staged limit is its term, 10 GB/s, and
        # the in-place limit the tensor term's 20.
        doc["limit"] = dict(_limit_at(40.0), handoff_gbs=10.0)
    s = _best.summarize([job] * 3, "pycomm")
    staged = _limit.limit_busbw("all_reduce", n, 2, 40.0, 40.0, 10.0)
    in_place = _limit.limit_busbw("all_reduce", n, 2, 40.0, 40.0, 10.0, staged=False)
    assert (staged, in_place) == (pytest.approx(10.0), pytest.approx(20.0))
    fam = s["limit_fraction_by_family"]
    assert set(fam) == {f"all_reduce|pycomm|{n}", f"all_reduce|pycomm-registered|{n}"}
    assert fam[f"all_reduce|pycomm-registered|{n}"][0] == pytest.approx(
        n / 100e-6 / 1e9 / in_place)
    assert fam[f"all_reduce|pycomm|{n}"][0] == pytest.approx(n / 200e-6 / 1e9 / staged)
    assert fam[f"all_reduce|pycomm|{n}"][0] == pytest.approx(
        s["limit_fraction"][f"all_reduce|{n}"][0])
    same_run = s["limit_fraction_same_run_by_family"][f"all_reduce|pycomm-registered|{n}"]
    assert same_run[3] == 6  # [median, min, max, count]: every run of 3 jobs of 2 runs
    assert same_run[0] == pytest.approx(n / 100e-6 / 1e9 / in_place)
    header, _, row = tables.table({"first": "pycomm", "best": s}, "all_reduce")
    head, cells = header.split(" | "), row.split(" | ")
    assert head[-1] == "pycomm-registered / in-place limit |"
    assert cells[-1].startswith(f"{fam[f'all_reduce|pycomm-registered|{n}'][0]:.2f}")
    at = head.index("in-place limit busbw GB/s")
    assert head[at - 1] == "limit busbw GB/s"
    assert (float(cells[at - 1]), float(cells[at])) == (pytest.approx(10.0), pytest.approx(20.0))


def test_the_in_place_limit_counts_every_byte_a_rank_touches_at_the_local_rate():
    """Read in place, an op's least time is its bytes read plus written at the local rate,
    whatever the core-to-core rate (no byte has to cross); staged, the slower of the two
    terms."""
    s, w = 1 << 20, 4
    for op, touched in (("all_reduce", 2 * s), ("reduce_scatter", s + s / w),
                        ("all_gather", 2 * s), ("broadcast", 2 * s)):
        assert _limit.limit_seconds(op, s, w, 50.0, 50.0, 1.0, staged=False) == pytest.approx(
            touched / 50e9)
        assert _limit.limit_seconds(op, s, w, 50.0, 50.0, 1.0) > touched / 50e9


def test_a_failed_run_leaves_no_earlier_file_to_summarize(tmp_path, monkeypatch):
    """A job whose run fails must not pick up the file an earlier session left at its
    path (a stale job1.json once joined a fresh summary that way)."""
    import argparse
    import subprocess

    from bench import _jobs

    out = tmp_path / "t.json"
    stale = tmp_path / "t.job1.json"
    stale.write_text(json.dumps({"meta": {"nproc": 2}, "results": [_row("pycomm", 1.0)]}))
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, returncode=1))
    args = argparse.Namespace(jobs=1, load=0, load_kind="cpu", out=out, tuned=False,
                              mpi_tuned=False, backends=["pycomm"], require_all=False)
    assert _jobs.run_jobs(["--backends", "pycomm"], args) == 1
    assert not stale.exists()
    assert not out.exists()  # nothing ran: no summary, rather than one of old files


def test_require_all_stops_at_a_peer_that_cannot_run(tmp_path, capfd):
    """--require-all: a named backend that cannot run here stops the job before it measures
    (a summary once lost DeepSpeed's column that way, DeepSpeed not being installed), and
    with --jobs no summary is written."""
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as done:
        main(["--backends", "pycomm,no-such-backend", "--require-all", "--jobs", "3",
              *TINY, "--out", str(out)])
    assert done.value.code
    assert "no-such-backend cannot run" in capfd.readouterr().err
    assert not out.exists() and not (tmp_path / "r.job2.json").exists()


def _gloo_variants_end_before_exit():
    """On a rank: the OS threads after making every gloo variant and closing them."""
    import gc

    import torch.distributed as dist

    from bench.collectives import close_groups, make_groups

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    dist.barrier()
    before = threads()
    groups, skipped = make_groups(list(_gloo.VARIANTS))
    during = threads()
    comms = list(groups.values())
    close_groups(groups)
    gc.collect()
    return {"skipped": skipped, "before": before, "during": during, "after": threads(),
            "closed": all(c.pg is None for c in comms)}


def test_gloo_variants_are_closed_before_the_interpreter_exits():
    """Their worker threads end while Python is whole: a worker left to drop its last
    tensor reference at interpreter exit aborted a finished job (exit 134)."""
    from pycomm.testing import run_ranks

    for r in run_ranks(_gloo_variants_end_before_exit, 2, backend="gloo", timeout_s=120):
        assert not r["skipped"] and r["closed"], r
        assert r["during"] > r["before"], r  # the variants' workers ran
        assert r["after"] <= r["before"], r  # and are gone
