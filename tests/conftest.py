"""Shared fixtures: the backend under test, and a leak check after every test.

``PYCOMM_TEST_BACKEND=gloo`` (or ``--backend=gloo``) runs the collective tests
against gloo, which validates the tests themselves without the pycomm extension (it sets
PYCOMM_ALLOW_NO_EXTENSION=1, without which ``import pycomm`` raises when the extension
does not load).

A pycomm that cannot be loaded fails every test that needs it (it never skips them),
and a skip whose reason names no missing resource fails the session
(tests/_skip_policy.py): a broken build cannot pass as a run of skips.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from pathlib import Path

import _leaks
import _skip_policy
import pytest
import torch.distributed as dist


def pycomm_unavailable() -> str | None:
    """None if the pycomm backend is registered and its extension loads, else why not."""
    import pycomm

    if getattr(dist.Backend, "PYCOMM", None) != "pycomm":
        return "importing pycomm did not register a 'pycomm' torch.distributed backend"
    return pycomm.extension_error()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/benchmarks holds micro-benchmarks: collected only with --benchmark-only."""
    if collection_path.name == "benchmarks" and not config.getoption("benchmark_only", False):
        return True
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("PYCOMM_TEST_BACKEND", "pycomm"),
        choices=["pycomm", "gloo"],
        help="torch.distributed backend for the collective tests (env PYCOMM_TEST_BACKEND)",
    )


def pytest_configure(config: pytest.Config) -> None:
    _skip_policy.install(config)
    # .ci/run reruns these under each ATEN_CPU_CAPABILITY (default, avx2, avx512): their
    # bounds are on floating-point results that depend on the CPU's vector kernels.
    config.addinivalue_line("markers", "precision: a bound on low-precision (bf16/fp16) or "
                            "kernel-dependent rounding; CI reruns it per ATEN_CPU_CAPABILITY")
    if config.getoption("--backend") == "gloo":  # before any test module imports pycomm
        os.environ.setdefault("PYCOMM_ALLOW_NO_EXTENSION", "1")


def _pycomm_missing(config: pytest.Config, what: str) -> None:
    """Fail (skip only under --backend=gloo) when pycomm cannot be loaded."""
    reason = pycomm_unavailable()
    if reason is None:
        return
    if config.getoption("--backend") == "gloo":
        pytest.skip(f"gloo: {what} needs pycomm, which is not loaded here ({reason})")
    pytest.fail(f"{what} needs pycomm, which cannot be loaded ({reason}). A broken or "
                "missing build fails the tests; PYCOMM_TEST_BACKEND=gloo runs the "
                "backend-agnostic tests on gloo without it.", pytrace=False)


@pytest.fixture(scope="session")
def require_pycomm(request: pytest.FixtureRequest) -> None:
    """Fail, saying why, when the pycomm backend is not available (under
    ``--backend=gloo``: skip, saying so)."""
    _pycomm_missing(request.config, "this test")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test; fails when it is pycomm and pycomm is not available."""
    name: str = request.config.getoption("--backend")
    if name == "pycomm":
        _pycomm_missing(request.config, "the backend under test (pycomm)")
    return name


def _pycomm_shm() -> set[str]:
    """Names in /dev/shm that belong to pycomm (not to a concurrent run: tests/_leaks.py)."""
    return _leaks.pycomm_shm()


def _helper_pids() -> set[int]:
    """multiprocessing's own long-lived helpers (forkserver, resource tracker)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid}


def _live_children(parents: set[int]) -> dict[int, str]:
    """pid -> command line of every non-zombie process whose parent is in ``parents``."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue  # the process exited while we looked
        state, ppid = fields[0], int(fields[1])
        if ppid in parents and state != "Z":
            found[int(stat.parent.name)] = cmdline.decode(errors="replace").strip()
    return found


def _pool_pids() -> set[int]:
    """Ranks of open RankPools and workers of open pathways clusters (module-scoped
    fixtures keep them across tests)."""
    try:
        from pycomm.testing import live_rank_pids
    except ImportError:
        return set()
    from pycomm.parallel.pathways.cluster import live_worker_pids

    return live_rank_pids() | live_worker_pids() | _ray_pids()


def _ray_pids() -> set[int]:
    """The processes of the local Ray instance a test session started (its GCS, raylet
    and monitors live as long as the session's Ray fixture)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return set()
    node = ray._private.worker._global_node
    return {p.process.pid for infos in node.all_processes.values() for p in infos}


def _leftover_processes() -> dict[int, str]:
    """Children of this test process, or of its forkserver, still alive (pools excepted)."""
    mp.active_children()  # reaps finished multiprocessing children as a side effect
    helpers = _helper_pids()
    children = _live_children({os.getpid()} | helpers)
    return {pid: cmd for pid, cmd in children.items() if pid not in helpers | _pool_pids()}


def _check_leaks(shm_before: set[str], check_shm: bool) -> None:
    """Assert no new pycomm /dev/shm names and no stray children; kill the strays."""
    leaked_shm = sorted(_pycomm_shm() - shm_before) if check_shm else []
    leftover = _leftover_processes()
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    mp.active_children()
    problems = []
    if leaked_shm:
        problems.append("/dev/shm entries left behind: " + ", ".join(leaked_shm))
    if leftover:
        problems.append("child processes left alive (now killed): "
                        + "; ".join(f"{pid}: {cmd}" for pid, cmd in leftover.items()))
    assert not problems, "\n".join(problems)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves pycomm shared memory or a live child process behind.

    Only /dev/shm names that appeared during the test count, so a concurrent run on
    the same machine does not fail unrelated tests. While a RankPool is open its
    segments legitimately exist, so the /dev/shm check is then left to
    ``no_module_leaks``. Stray processes are killed after being reported so that one
    leak does not fail every later test.
    """
    shm_before = _pycomm_shm()
    yield
    _check_leaks(shm_before, check_shm=not _pool_pids())


@pytest.fixture(autouse=True, scope="module")
def no_module_leaks():
    """The same check once a module's own fixtures (its RankPools) are torn down."""
    shm_before = _pycomm_shm()
    yield
    _check_leaks(shm_before, check_shm=True)
