"""The examples install as pycomm.examples and run as the README runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pycomm.examples


def test_the_example_data_files_are_beside_the_examples():
    assert {p.name for p in pycomm.examples.FOLDER.iterdir()} >= {
        "train_ddp.py", "train_gpt.toml", "mixtral-tiny.json"}


def test_train_ddp_runs_under_torchrun_as_a_module(tmp_path):
    # torchrun is torch's console script for python -m torch.distributed.run
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "pycomm.examples.train_ddp", "--steps", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(re.findall(r"^step +\d+ +loss \d", done.stdout, re.M)) == 3, done.stdout
    assert "parameters identical on all 2 ranks (pycomm)" in done.stdout
