"""PYCOMM_DEBUG, PYCOMM_DEBUG_SUBSYS and PYCOMM_DEBUG_FILE, shaped like NCCL's logging:
INFO says the init-time choices once per rank and nothing per op, TRACE adds a line per
op, the subsystem filter drops lines by subsystem, and the file gets one per process."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist

from pycomm.testing import RankPool, run_ranks

pytestmark = pytest.mark.usefixtures("require_pycomm")

# Once per rank at group creation: the version (Python), the C++ init lines, the segment.
INIT_LINES = ("INFO init: pycomm ", "INFO islands: group of 2", "INFO init: rank ",
              "INFO init: algorithm ", "INFO shm: segment ")
OP_LINE = re.compile(r"PYCOMM TRACE seq \d+ all_reduce float32\[\d+\] SUM: \w+")


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, backend="pycomm", pg_timeout_s=30) as pool:
        yield pool


@contextlib.contextmanager
def _env(settings: dict[str, str]):
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _all_reduces() -> None:
    group = dist.new_group(backend="pycomm")
    for n in (4, 1000, 1 << 20):
        dist.all_reduce(torch.ones(n), group=group)
    dist.destroy_process_group(group)


def _logged(settings: dict[str, str]) -> tuple[str, int, str]:
    """This rank's stderr (fd 2) while a new group with ``settings`` runs 3 all_reduces."""
    with _env(settings), tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            _all_reduces()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return log.read(), os.getpid(), socket.gethostname()


def test_info_says_the_init_choices_once_per_rank_and_nothing_per_op(pool):
    for rank, (text, pid, host) in enumerate(pool.run(_logged, {"PYCOMM_DEBUG": "INFO"})):
        lines = text.splitlines()
        for want in INIT_LINES:
            assert sum(want in line for line in lines) == 1, f"{want!r} on rank {rank}:\n{text}"
        assert all(line.startswith(f"{host}:{pid}:") for line in lines), text
        assert all(f" [{rank}] PYCOMM INFO " in line for line in lines), text
        assert "seq " not in text and "TRACE" not in text, text


def test_trace_adds_a_line_per_op(pool):
    for text, _, _ in pool.run(_logged, {"PYCOMM_DEBUG": "TRACE"}):
        assert len(OP_LINE.findall(text)) == 3, text
        assert "all_reduce float32[4] SUM: direct" in text, text
        assert "all_reduce float32[1048576] SUM: pair" in text, text  # 2 ranks
        assert len(re.findall(r"PYCOMM TRACE seq \d+ done in \d+ us", text)) == 3, text
        assert "INFO init: rank " in text, text


def test_subsys_excluding_coll_drops_the_op_lines(pool):
    settings = {"PYCOMM_DEBUG": "TRACE", "PYCOMM_DEBUG_SUBSYS": "^COLL"}
    for text, _, _ in pool.run(_logged, settings):
        assert "seq " not in text, text
        assert "INFO init: rank " in text and "INFO shm: segment " in text, text


def test_subsys_list_keeps_only_those(pool):
    settings = {"PYCOMM_DEBUG": "TRACE", "PYCOMM_DEBUG_SUBSYS": "coll, SHM"}
    for text, _, _ in pool.run(_logged, settings):
        assert len(OP_LINE.findall(text)) == 3, text
        assert "INFO shm: segment " in text, text
        assert "init:" not in text and "islands:" not in text, text


def _pid_and_host() -> tuple[int, str]:
    _all_reduces()
    return os.getpid(), socket.gethostname()


def test_debug_file_gets_one_file_per_process(tmp_path):
    env = {"PYCOMM_DEBUG": "INFO", "PYCOMM_DEBUG_FILE": str(tmp_path / "log.%h.%p")}
    ranks = run_ranks(_pid_and_host, 2, env=env, pg_timeout_s=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"log.{host}.{pid}" for pid, host in ranks)
    for rank, (pid, host) in enumerate(ranks):
        text = (tmp_path / f"log.{host}.{pid}").read_text()
        # Two groups: the default one and _all_reduces' own.
        assert text.count("INFO init: rank ") == 2, text
        assert all(f":{pid}:" in line and f" [{rank}] " in line for line in text.splitlines())


def test_debug_file_that_cannot_be_opened_falls_back_to_stderr(tmp_path, capfd):
    env = {"PYCOMM_DEBUG": "INFO", "PYCOMM_DEBUG_FILE": str(tmp_path / "missing" / "log.%p")}
    run_ranks(_pid_and_host, 2, env=env, pg_timeout_s=30)
    err = capfd.readouterr().err  # the ranks' stderr, echoed by pycomm.testing
    assert err.count("PYCOMM WARN PYCOMM_DEBUG_FILE=") == 2, err
    assert "(No such file or directory); logging to stderr" in err, err
    assert "PYCOMM INFO init: rank " in err, err


@pytest.mark.parametrize(("name", "value", "message"), [
    ("PYCOMM_DEBUG", "LOUD", "PYCOMM_DEBUG=LOUD is not one of WARN, INFO, TRACE"),
    ("PYCOMM_DEBUG_SUBSYS", "INIT,FOO",
     "PYCOMM_DEBUG_SUBSYS=INIT,FOO: 'FOO' is not a subsystem; the subsystems are "
     "INIT, COLL, P2P, SHM, ISLANDS"),
])
def test_bad_values_name_the_variable_and_the_allowed_values(monkeypatch, name, value, message):
    from pycomm import _C, _log

    monkeypatch.setenv("PYCOMM_DEBUG", "INFO")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        _log.enabled("INFO", "INIT")
    with pytest.raises(ValueError, match=re.escape(message)):
        _C._segment_bytes(2)  # the communicator's own settings (Config::from_env)


def test_python_lines_share_the_format_and_filter(monkeypatch, capfd):
    from pycomm import _log

    monkeypatch.setenv("PYCOMM_DEBUG", "INFO")
    monkeypatch.setenv("PYCOMM_DEBUG_SUBSYS", "^ISLANDS")
    _log.info("INIT", 3, "hello")
    _log.info("ISLANDS", 3, "filtered out")
    _log.warn("ISLANDS", 3, "warnings always print")
    err = capfd.readouterr().err
    host, pid = socket.gethostname(), os.getpid()
    assert re.search(rf"^{re.escape(host)}:{pid}:\d+ \[3\] PYCOMM INFO hello$", err, re.M), err
    assert "filtered out" not in err
    assert "[3] PYCOMM WARN warnings always print" in err
