"""``bench.step_time`` end to end on tiny models: every requested row comes back with a
step time or the reason it has none, the fake baseline drives every layout it can, and
the JSON holds what a result needs to be read later."""

import json
import subprocess
from itertools import product
from pathlib import Path

import pytest

from bench._step_layouts import LAYOUTS
from bench.step_time import main

pytest.importorskip("transformers")

TINY = ["--size", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "1", "--batch", "4"]
BACKENDS = ("gloo", "pycomm", "fake")


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "step_time.json"
    assert main([*TINY, *flags, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_rows(doc: dict, models: list[str], layouts: list[str], threads: list[str],
                backends: list[str]) -> dict[tuple, dict]:
    """Exactly the requested rows, each with a positive step time or a stated reason,
    exposed comm and the ratio as the table defines them."""
    rows = {(r["model"], r["layout"], r["threads"], r["backend"]): r for r in doc["rows"]}
    assert sorted(rows) == sorted(product(models, layouts, threads, backends))
    for key, r in rows.items():
        if "step_ms" not in r:
            assert r["reason"].strip(), key
            continue
        st = r["step_ms"]
        assert 0 < st["min"] <= st["median"] <= st["max"], key
        fake = rows.get((*key[:3], "fake"), {}).get("step_ms")
        if fake is None:
            assert r["exposed_ms"] is None, key
        else:
            assert r["exposed_ms"] == pytest.approx(st["median"] - fake["median"]), key
        gloo = rows.get((*key[:3], "gloo"), {}).get("step_ms")
        if key[3] == "pycomm" and gloo:
            assert r["pycomm_over_gloo"] == pytest.approx(st["median"] / gloo["median"]), key
    return rows


def test_every_layout_of_both_models(tmp_path: Path) -> None:
    doc = _run(tmp_path, "--models", "gpt,llama", "--threads", "1")
    rows = _check_rows(doc, ["gpt", "llama"], list(LAYOUTS), ["1"], list(BACKENDS))
    for (model, layout, _, backend), r in rows.items():
        if layout == "pp" and backend == "fake":
            assert "step_ms" not in r and "fake backend" in r["reason"]
            continue
        # Every other cell runs: a reason here is a regression, not a stated limit.
        assert "step_ms" in r, (model, layout, backend, r.get("reason"))
        assert r["rank_threads"] == [1]
        if backend == "fake":
            assert r["exposed_ms"] == 0.0  # the baseline has no exposed comm by definition
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert doc["commit"] == head
    assert doc["torch"] and doc["date"] and doc["cpu_count"] >= 1
    assert len(doc["loadavg"]) == 3
    assert set(doc["params"]) == {"gpt", "llama"} and min(doc["params"].values()) > 0
    # the raw step times behind every row: per cell, per job, every rank's rounds
    assert {tuple(k.split("|")) for k in doc["raw"]} == {key[:3] for key in rows}


def test_default_threads_and_a_backend_subset(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Passive: on a loaded 2-core host libgomp's spinning threads (2 ranks x torch's
    # default count) made this tiny case take minutes; the ranks inherit the setting.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    doc = _run(tmp_path, "--models", "gpt", "--layouts", "ddp,pp", "--threads", "default",
               "--backends", "pycomm,fake")
    rows = _check_rows(doc, ["gpt"], ["ddp", "pp"], ["default"], ["pycomm", "fake"])
    assert rows[("gpt", "ddp", "default", "fake")]["exposed_ms"] == 0.0
    # No gloo row asked for: no ratio; pp has no fake baseline: no exposed comm.
    assert rows[("gpt", "ddp", "default", "pycomm")]["pycomm_over_gloo"] is None
    assert rows[("gpt", "pp", "default", "pycomm")]["exposed_ms"] is None
    assert doc["default_threads"] >= 1
    assert doc["env"].get("OMP_WAIT_POLICY") == "PASSIVE"  # recorded with the results
    # "default" ranks run torch's own count, not run_ranks' 1.
    assert rows[("gpt", "ddp", "default", "fake")]["rank_threads"] == [doc["default_threads"]]


def test_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit):
        main(["--layouts", "ddp,nope"])
    with pytest.raises(SystemExit):
        main(["--batch", "3"])
