"""``python -m pycomm.env``: the report's sections and the facts that can be checked here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pycomm import env

ROOT = Path(__file__).resolve().parent.parent


def _report(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    run_env = dict(os.environ, PYTHONPATH=str(ROOT), **extra_env)
    return subprocess.run([sys.executable, "-m", "pycomm.env", *args], env=run_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def text_report() -> str:
    done = _report("--ranks", "4", PYCOMM_X="hello", PYCOMM_ALGO="ring")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_text_report_has_every_section(text_report):
    for title in ("pycomm", "torch", "platform", "/dev/shm", "namespaces",
                  "PYCOMM_* in effect", "PYCOMM_* known (default)"):
        assert f"\n{title}\n" in f"\n{text_report}", title


def test_text_report_names_versions_and_variables(text_report):
    assert f"running        {torch.__version__}\n" in text_report
    assert f"built against  {env.base_version(torch.__version__)}\n" in text_report
    assert re.search(r"\n  PYCOMM_X +hello\n", text_report)
    assert re.search(r"\n  PYCOMM_ALGO +ring\n", text_report)
    assert "WARN PYCOMM_X is not a variable pycomm reads" in text_report
    assert "need (4 ranks)" in text_report


def test_json_report_matches_torch_and_this_process():
    done = _report("--json", "--ranks", "3", PYCOMM_X="1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    t = report["torch"]
    assert t["running"] == torch.__version__
    assert t["built_against"] == env.base_version(torch.__version__)
    assert t["match"] is True
    assert t["cxx11_abi"] == t["extension_cxx11_abi"] == torch._C._GLIBCXX_USE_CXX11_ABI
    assert report["variables"]["set"]["PYCOMM_X"] == "1"
    assert set(report["variables"]["known"]) >= {"PYCOMM_DEBUG", "PYCOMM_DEBUG_SUBSYS",
                                                 "PYCOMM_DEBUG_FILE", "PYCOMM_CHUNK_BYTES"}
    need = report["shm"]["need"]
    assert report["shm"]["ranks"] == 3
    assert 0 < need["at_init"] < need["ring"] < need["every_channel"]
    assert report["platform"]["python"] == sys.version.split()[0]
    # the machine's facts are torch's collect_env's (what torch's bug reports give)
    from torch.utils import collect_env

    assert report["platform"]["os"] == collect_env.get_env_info().os
    assert report["platform"]["cpus usable"] == len(os.sched_getaffinity(0))


def test_a_collect_env_that_fails_is_said_and_the_report_goes_on(monkeypatch):
    def broken():
        raise OSError("lscpu: not found")

    monkeypatch.setattr(env, "_torch_env_info", broken)
    section = env.platform_section()
    assert "lscpu: not found" in section["collect_env"]
    assert section["python"] == sys.version.split()[0] and section["cpus"] == os.cpu_count()


def test_shm_need_follows_the_chunk_size(monkeypatch):
    from pycomm import _C

    base = env.shm_need(_C, 4)
    monkeypatch.setenv("PYCOMM_CHUNK_BYTES", str(1 << 20))
    bigger = env.shm_need(_C, 4)
    assert bigger.at_init == base.at_init  # channels are reserved as they are used
    # Each of the 4 ranks' ring channels starts with 4 buffers, each 4x larger now.
    assert bigger.ring - base.ring >= 4 * 4 * ((1 << 20) - (256 << 10))


def test_shm_need_counts_the_two_shot_stage_areas(monkeypatch):
    from pycomm import _C

    piece = 512 << 10  # PYCOMM_TWO_SHOT_PIECE_BYTES' default
    with_stages = env.shm_need(_C, 4)
    monkeypatch.setenv("PYCOMM_TWO_SHOT_BYTES", "0")
    assert with_stages.ring - env.shm_need(_C, 4).ring == 4 * 4 * piece
    monkeypatch.delenv("PYCOMM_TWO_SHOT_BYTES")
    monkeypatch.setenv("PYCOMM_TWO_SHOT_PIECE_BYTES", str(2 * piece))
    assert env.shm_need(_C, 4).ring - with_stages.ring == 4 * 4 * piece
    assert _C._segment_bytes(2)["stage"] == 0  # two ranks take the pair exchange


NEED = env.ShmNeed(ranks=8, at_init=1 * env.MiB, ring=9 * env.MiB, every_channel=113 * env.MiB)


def test_tiny_shm_is_too_small_and_says_how_to_fix_it():
    (warning,) = env.check_shm(size=4 * env.MiB, free=4 * env.MiB, need=NEED)
    assert "too small" in warning and "8 ranks" in warning
    assert "--shm-size=1g" in warning and "medium: Memory" in warning


def test_docker_default_shm_is_enough_for_rings_only():
    (warning,) = env.check_shm(size=64 * env.MiB, free=64 * env.MiB, need=NEED)
    assert "enough for ring collectives" in warning and "all_to_all" in warning


def test_large_shm_gives_no_warning():
    assert env.check_shm(size=1 << 30, free=1 << 30, need=NEED) == []


def test_cuda_arch_list_reads_as_sm_names():
    assert env.format_archs("800,900") == "sm_80, sm_90"
    assert env.format_archs("unknown") == "unknown"


def test_nested_pid_namespace_is_read_from_nspid():
    assert env.nspids("Name:\tpython\nNSpid:\t4242\t7\n") == [4242, 7]
    assert env.nspids("Name:\tpython\n") == []


def test_extension_that_does_not_load_exits_1_and_says_why(monkeypatch, capsys):
    def broken():
        raise RuntimeError("pycomm: the C++ extension pycomm._C cannot be loaded (test)")

    monkeypatch.setattr(env, "_extension", broken)
    assert env.main(["--ranks", "2"]) == 1
    assert "NOT LOADED: pycomm: the C++ extension pycomm._C cannot be loaded (test)" in (
        capsys.readouterr().out)


def test_shm_need_counts_a_segment_per_stripe(monkeypatch):
    from pycomm import _C

    base = env.shm_need(_C, 2)
    monkeypatch.setenv("PYCOMM_STRIPES", "4")
    striped = env.shm_need(_C, 2)
    assert (striped.at_init, striped.ring, striped.every_channel) == (
        4 * base.at_init, 4 * base.ring, 4 * base.every_channel)
