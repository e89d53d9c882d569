"""The skip policy (tests/_skip_policy.py) and the failing fixtures (tests/conftest.py):
a broken build, or a skip that names no missing resource, must make pytest exit
non-zero; skips for a named missing resource must not.

Each case runs pytest in a subprocess on a small generated test file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _skip_policy import reason_allowed

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """pytest -p _skip_policy on one generated test file, outside this project's tree."""
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "_skip_policy", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_generated.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


NAMED = """
    import pytest

    def test_runs():
        pass

    @pytest.mark.skipif(True, reason="no CUDA device")
    def test_gpu():
        pass

    def test_mpi():
        pytest.skip("no Open MPI/mpi4py: mpirun is not on PATH")
"""


def test_skips_for_named_resources_pass(tmp_path):
    done = _pytest(tmp_path, NAMED)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 2 skipped" in done.stdout, done.stdout
    assert "skip policy" not in done.stdout.lower(), done.stdout


UNNAMED = """
    import pytest

    def test_runs():
        pass

    def test_hidden_breakage():
        pytest.skip("could not import 'pycomm._C': undefined symbol")

    @pytest.mark.skipif(True, reason="flaky on CI")
    def test_flaky():
        pass
"""


def test_a_skip_without_a_named_resource_fails_the_session(tmp_path):
    done = _pytest(tmp_path, UNNAMED)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 passed, 2 skipped" in out, out
    assert "SKIP WITHOUT A NAMED RESOURCE (1 tests): could not import 'pycomm._C'" in out, out
    assert "test_generated.py::test_hidden_breakage" in out, out
    assert "SKIP WITHOUT A NAMED RESOURCE (1 tests): flaky on CI" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAILED by the skip policy: 2 test(s) skipped"), out


def test_importorskip_at_module_level_fails_the_session(tmp_path):
    done = _pytest(tmp_path, """
        import pytest
        pytest.importorskip("a_module_that_is_not_there")

        def test_never_runs():
            pass
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "could not import 'a_module_that_is_not_there'" in done.stdout, done.stdout


def test_xfail_is_not_a_skip(tmp_path):
    done = _pytest(tmp_path, """
        import pytest

        @pytest.mark.xfail(reason="known gloo limitation", strict=True)
        def test_x():
            assert False
    """)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_failing_run_keeps_its_own_exit_status(tmp_path):
    done = _pytest(tmp_path, """
        import pytest

        def test_fails():
            assert False

        def test_skips():
            pytest.skip("why not")
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SKIP WITHOUT A NAMED RESOURCE (1 tests): why not" in done.stdout, done.stdout


@pytest.mark.parametrize(("reason", "backend", "allowed"), [
    ("no CUDA GPU", "pycomm", True),
    ("no nvcc (neither on PATH nor in $CUDA_HOME/bin)", "pycomm", True),
    ("no network namespaces: `ip netns add` failed: Operation not permitted", "pycomm", True),
    ("no PID namespaces: unshare --pid not permitted: Operation not permitted", "pycomm", True),
    ("no root: making a file owned by another user needs it", "pycomm", True),
    ("not x86-64: the kernels' ISA clones are x86-64 only", "pycomm", True),
    ("no objdump (binutils)", "pycomm", True),
    ("gloo: ReduceOp.PREMUL_SUM is not supported", "gloo", True),
    ("gloo: ReduceOp.PREMUL_SUM is not supported", "pycomm", False),  # only under gloo
    ("pycomm: the C++ extension pycomm._C cannot be loaded (...)", "pycomm", False),
    ("could not import 'pycomm._C': No module named 'pycomm._C'", "pycomm", False),
    ("needs a GPU sometimes", "pycomm", False),  # must start with the missing resource
])
def test_reason_allowlist(reason, backend, allowed):
    assert reason_allowed(reason, backend) is allowed


# --- the project's own conftest: a pycomm that cannot load fails, it does not skip ------

BROKEN_BUILD = """
    import pytest

    @pytest.mark.usefixtures("require_pycomm")
    def test_needs_pycomm():
        pass

    def test_backend(backend):
        assert backend in ("pycomm", "gloo")
"""


def _copy_with_broken_extension(tmp_path: Path) -> Path:
    """A copy of the package whose pycomm._C raises ImportError, with the project's
    conftest and skip policy next to the generated test."""
    tree = tmp_path / "tree"
    (tree / "pycomm").mkdir(parents=True)
    (tree / "tests").mkdir()
    for src in (ROOT / "pycomm").glob("*.py"):
        (tree / "pycomm" / src.name).write_text(src.read_text())
    (tree / "pycomm" / "_C.py").write_text(
        'raise ImportError("undefined symbol: _ZN6pycomm4fake (a broken build)")\n')
    for name in ("conftest.py", "_skip_policy.py", "_leaks.py"):
        (tree / "tests" / name).write_text((TESTS / name).read_text())
    (tree / "tests" / "test_generated.py").write_text(textwrap.dedent(BROKEN_BUILD))
    return tree


def _run_tree(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYCOMM_TEST_BACKEND"}
    environ.update(PYTHONPATH=str(tree), **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tree), "tests/test_generated.py", *args],
        cwd=tree, env=environ, capture_output=True, text=True, timeout=120)


def test_a_broken_extension_fails_the_fixtures(tmp_path):
    tree = _copy_with_broken_extension(tmp_path)
    done = _run_tree(tree)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "2 errors" in out and "skipped" not in out, out
    assert "cannot be loaded" in out and "a broken build" in out, out


def test_a_broken_extension_is_a_named_skip_under_gloo(tmp_path):
    tree = _copy_with_broken_extension(tmp_path)
    done = _run_tree(tree, PYCOMM_TEST_BACKEND="gloo")
    out = done.stdout
    assert "1 passed, 1 skipped" in out, out  # the backend fixture gives "gloo"
    assert done.returncode == 0, out + done.stderr
