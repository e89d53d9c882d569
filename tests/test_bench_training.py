"""bench.training on a tiny model: every strategy runs, agrees on the loss, and the
JSON and PNG are written."""

import importlib.util
import json

import pytest

from bench.training import main


def _assert_plot(out, text):
    """The PNG beside the JSON, or (matplotlib is optional) the line saying there is none."""
    if importlib.util.find_spec("matplotlib") is None:
        assert ("no plot: matplotlib is not installed (pip install "
                "'pycomm-collectives[bench]'") in text
    else:
        assert out.with_suffix(".png").stat().st_size > 0


@pytest.fixture
def tiny(tmp_path):
    return ["--model", "tiny", "--steps", "2", "--rounds", "2", "--warmup", "1"], tmp_path


def test_data_runs_every_strategy_and_they_agree(tiny, capsys, require_pycomm):
    flags, tmp = tiny
    out = tmp / "data.json"
    main(["data", *flags, "-o", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"local", "ddp-gloo", "ddp-pycomm", "ddp-pycomm-arena",
                         "parallel.data-pycomm", "parallel.data-gloo"}
    synced = [r["loss"] for name, r in rows.items() if name != "local"]
    assert max(synced) - min(synced) < 1e-4, rows  # same data, same averaged updates
    assert rows["parallel.data-pycomm"]["grad_arena_mb"] > 0
    assert all(r["peak_rss_mb"] > 0 and r["median_ms"] > 0 for r in rows.values())
    text = capsys.readouterr().out
    assert "exposed comm, parallel.data-pycomm / ddp-gloo" in text
    _assert_plot(out, text)


def test_buckets_reports_both_backends(tiny, capsys, require_pycomm):
    flags, tmp = tiny
    out = tmp / "buckets.json"
    main(["buckets", *flags, "-o", str(out)])
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"pycomm", "gloo"}
    for r in res.values():
        assert r["tensors"] == 29 and r["buckets"] == 1
        assert r["one_by_one_s"] > 0 and r["bucketed_s"] > 0
    text = capsys.readouterr().out
    assert "speed-up" in text
    _assert_plot(out, text)


def test_zero_runs_stages_and_torch_peers_on_both_backends(tiny, capsys, require_pycomm):
    flags, tmp = tiny
    out = tmp / "zero.json"
    main(["zero", *flags, "--no-memory", "--strategies",
          "torch-zero1-gloo,parallel.zero1-pycomm,parallel.zero2-gloo,torch-fsdp2-pycomm,"
          "parallel.zero3-pycomm,parallel.zero3-bf16-gloo", "-o", str(out)])
    rows = json.loads(out.read_text())["results"]
    losses = [r["loss"] for name, r in rows.items() if "bf16" not in name]
    assert len(rows) == 6 and max(losses) - min(losses) < 1e-4, rows
    text = capsys.readouterr().out
    assert "# pycomm: parallel.zero3 / torch-fsdp2: step time" in text
    _assert_plot(out, text)


def test_tensor_runs_dtensor_and_parallel_tensor_and_they_agree(tiny, capsys, require_pycomm):
    flags, tmp = tiny
    out = tmp / "tensor.json"
    flags = [f if f != "tiny" else "tiny-tp" for f in flags]
    main(["tensor", *flags, "--no-memory", "--strategies",
          "unsharded,dtensor-tp-gloo,dtensor-tp-sp-pycomm,parallel.tensor-pycomm,"
          "parallel.tensor-sp-gloo", "-o", str(out)])
    rows = json.loads(out.read_text())["results"]
    losses = [r["loss"] for r in rows.values()]
    assert len(rows) == 5 and max(losses) - min(losses) < 1e-4, rows
    text = capsys.readouterr().out
    assert "# step time, parallel.tensor-pycomm / dtensor-tp-gloo:" in text
    _assert_plot(out, text)


def test_pipeline_runs_torch_and_ours_and_reports_bubble_and_memory(tmp_path, capsys,
                                                                      require_pycomm):
    out = tmp_path / "pipeline.json"
    main(["pipeline", "--width", "32", "--layers", "4", "--rows", "16", "--chunks", "4",
          "--steps", "2", "--rounds", "1", "--warmup", "1", "--no-memory", "--bubble-jobs", "2",
          "--strategies",
          "torch-gpipe-gloo,parallel.pipeline-gpipe-pycomm,parallel.pipeline-1f1b-gloo",
          "-o", str(out)])
    res = json.loads(out.read_text())["results"]
    assert set(res["strategies"]) == {"torch-gpipe-gloo", "parallel.pipeline-gpipe-pycomm",
                                      "parallel.pipeline-1f1b-gloo"}
    assert set(res["bubble"]) == {"1", "4", "16"}
    for m, stages in res["bubble"].items():  # the median of the two jobs' idle shares
        for s, share in stages.items():
            per_job = res["bubble_jobs"][m][s]
            assert len(per_job) == 2 and min(per_job) <= share <= max(per_job)
    # the last stage also keeps the loss's inputs, so it holds something in every mode
    never, always = (res["activation_bytes"][-1][f"gpipe/{m}"] for m in ("never", "always"))
    assert 0 < always < never
    text = capsys.readouterr().out
    assert "# gpipe: parallel.pipeline-pycomm / torch-gloo: throughput" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "pipeline_timeline.png").stat().st_size > 0


def test_recompute_bench_shows_p_a_halving_the_checkpointed_inputs(tmp_path, capsys,
                                                                    require_pycomm):
    from bench.recompute import main as recompute_main

    out = tmp_path / "recompute.json"
    recompute_main(["--tiny", "--rounds", "1", "--steps", "1", "-o", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert rows["checkpoint+P_a"]["arena_mb"] * 2 == pytest.approx(rows["checkpoint"]["arena_mb"])
    assert rows["checkpoint"]["saved_mb"] < rows["plain"]["saved_mb"]
    # per block: the fused MLP keeps a seed for its dropout mask (dropout 0.1 by default)
    unsharded = json.loads(out.read_text())["unsharded"]
    fused, plain = (unsharded[f"unsharded {m}"]["block_saved_mb"] for m in ("fused", "plain"))
    assert 0 < fused < plain
    assert rows["checkpoint"]["block_saved_mb"] < rows["plain"]["block_saved_mb"]
    text = capsys.readouterr().out
    assert "# recompute overhead" in text and "(b) fused, unsharded" in text
