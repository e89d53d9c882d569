"""bench.dispatch (pycomm's dispatch and combine against all_to_all peers): a tiny run
whose every peer delivers the same counts as pycomm and brings every row back, and the
summary of several jobs (medians, ranges, ratios to pycomm, the A/A column)."""

from __future__ import annotations

import json

import pytest

from bench import _mpi
from bench.dispatch import main, summarize

pytestmark = pytest.mark.usefixtures("require_pycomm")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dispatch") / "d.json"
    peers = ["pycomm", "pycomm#2", "pycomm-a2a", "gloo"] + ([] if _mpi.missing() else ["mpi"])
    main(["--nproc", "2", "--tokens", "64,96", "--hidden", "16", "--routing", "2/4,1/2",
          "--iters", "2", "--backends", ",".join(peers), "--out", str(out)])
    return peers, out


def test_every_peer_delivers_pycomms_counts_and_every_row_back(tiny_run):
    peers, out = tiny_run
    doc = json.loads(out.read_text())
    assert doc["skipped"] == {}
    cases = {tuple(r["case"]) for r in doc["rows"]}
    assert cases == {(64, 16, 2, 4), (64, 16, 1, 2), (96, 16, 2, 4), (96, 16, 1, 2)}
    assert sorted((tuple(r["case"]), r["peer"]) for r in doc["rows"]) == sorted(
        (c, p) for c in cases for p in peers)
    assert all(r["right"] for r in doc["rows"]), doc["rows"]
    assert all(r["dispatch_s"] > 0 and r["combine_s"] > 0 and r["limit_s"] > 0
               for r in doc["rows"])


def test_the_summary_has_a_row_per_case_and_peer_and_pycomm_is_one(tiny_run):
    peers, out = tiny_run
    table = summarize([out, out]).splitlines()
    rows = [line for line in table if line.startswith("| 64 x 16") or line.startswith("| 96")]
    assert len(rows) == 4 * len(peers)
    ours = [line for line in rows if line.split("|")[2].strip() == "pycomm"]
    assert all("| 1.00 [1.00-1.00] | 1.00 [1.00-1.00] | True |" in line for line in ours), ours
