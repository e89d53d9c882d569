"""bench.headline: medians and ranges across jobs, and the PNG it writes."""

import json

import pytest

from bench.headline import aggregate, main, spread


def _row(backend, nbytes, time_us, busbw):
    return {"op": "all_reduce", "backend": backend, "bytes": nbytes, "time_us": time_us,
            "busbw": busbw, "wrong": 0, "times_us": [time_us]}


def _job(path, rows, nproc=2, dtype="float32"):
    path.write_text(json.dumps({"meta": {"nproc": nproc, "datatype": dtype}, "results": rows}))
    return path


def test_spread_is_median_min_max():
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert spread([1.0, 4.0]) == (2.5, 1.0, 4.0)
    with pytest.raises(ValueError):
        spread([])


def test_aggregate_takes_each_point_across_jobs():
    job_a = [_row("pycomm", 1024, 4.0, 0.5), _row("gloo", 1024, 200.0, 0.01),
             _row("pycomm", 4096, 5.0, 1.5)]
    job_b = [_row("pycomm", 4096, 7.0, 1.1), _row("pycomm", 1024, 6.0, 0.3),
             _row("gloo", 1024, 100.0, 0.02), {**_row("pycomm", 1024, 1.0, 9.0), "op": "reduce"}]
    times = aggregate([job_a, job_b], "all_reduce", "time_us")
    assert list(times) == ["pycomm", "gloo"]
    assert times["pycomm"] == [(1024, 5.0, 4.0, 6.0), (4096, 6.0, 5.0, 7.0)]
    assert times["gloo"] == [(1024, 150.0, 100.0, 200.0)]
    assert aggregate([job_a, job_b], "all_reduce", "busbw")["pycomm"][0] == (1024, 0.4, 0.3, 0.5)


def test_main_writes_the_png(tmp_path, capsys):
    rows = [_row(b, n, t, n / t / 1e3) for b, t in (("pycomm", 4.0), ("gloo", 200.0))
            for n in (1024, 65536, 1 << 20)]
    a = _job(tmp_path / "a.json", rows)
    b = _job(tmp_path / "b.json", [{**r, "time_us": r["time_us"] * 2} for r in rows])
    out = tmp_path / "docs" / "headline.png"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 ranks, float32, median of 2 jobs" in capsys.readouterr().out


def test_jobs_of_other_ranks_are_refused(tmp_path):
    a = _job(tmp_path / "a.json", [_row("pycomm", 1024, 4.0, 0.5)])
    b = _job(tmp_path / "b.json", [_row("pycomm", 1024, 4.0, 0.5)], nproc=4)
    with pytest.raises(ValueError, match="nproc=4"):
        main([str(a), str(b), "--out", str(tmp_path / "x.png")])
