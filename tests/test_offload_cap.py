"""ZeRO-3 offload under a memory cap (a cgroup v1 memory controller's limit): a GPT whose
replicated fp32 Adam state is over 3x the cap trains 5 steps offloaded to files, and the
same model in memory (ZeRO-3 without offload) is killed by the cap."""

from __future__ import annotations

import json
import math
import os
import signal
import sys

import pytest

from bench._memcap import available, run_capped
from bench._offload_rank import CI_CAP, CI_CASE, state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(spec: dict) -> object:
    cmd = [sys.executable, "-m", "bench._offload_rank", json.dumps(spec)]
    return run_capped(cmd, CI_CAP, timeout_s=180.0, cwd=ROOT)


@pytest.fixture(scope="module")
def capped():
    reason = available()
    if reason:
        pytest.skip(reason)


def test_state_is_over_three_times_the_cap():
    assert state_bytes(CI_CASE) >= 3 * CI_CAP


def test_offloaded_trains_five_steps_under_the_cap(capped, tmp_path):
    run = _run({**CI_CASE, "offload": "disk", "dir": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.joined == 1 and run.oom_kills == 0
    assert run.max_usage_bytes <= CI_CAP
    rank = json.loads(run.stdout.strip().splitlines()[-1])["ranks"][0]
    assert len(rank["steps"]) == CI_CASE["steps"]
    assert all(math.isfinite(s["loss"]) for s in rank["steps"])
    stats = rank["offload"]
    assert stats["steps"] == CI_CASE["steps"] * rank["units"]
    # every step reads each unit's master (forward, 4 bytes a parameter) and its whole
    # record (backward, 12: master and two moments), and writes the record back
    steps, state = CI_CASE["steps"], state_bytes(CI_CASE)
    assert stats["bytes_read"] >= steps * state
    assert stats["bytes_written"] >= steps * state * 3 // 4
    assert os.listdir(tmp_path) == []  # the store's file is unlinked once open


def test_in_memory_zero3_is_killed_by_the_cap(capped):
    run = _run({**CI_CASE, "offload": "none"})
    assert run.joined == 1
    assert run.returncode == -signal.SIGKILL and run.oom_kills >= 1, run.stderr[-3000:]
    assert run.failcnt > 0
