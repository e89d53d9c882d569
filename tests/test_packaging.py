"""What pycomm ships: the sdist, the version, the CUDA architecture flags.

The sdist is built here (``python -m build --sdist --no-isolation``, from a copy of the
checkout so the build writes nothing into it) and read, not compiled: it must hold every
source setup.py compiles (the CPU and the CUDA build's), every header they include,
recursively, and LICENSE, README.md, pyproject.toml and setup.py; its packages are
pycomm and parallel, never bench (which runs from a checkout). That the sdist then
installs and works is the test that CI's second job does: it installs it with pip into
a fresh virtual environment with the oldest supported torch and runs the backend and
conformance tests against that install (.ci/run, "job 2"). Fast: no compiler runs here.

nvcc_flags() is imported from setup.py (its setup() call runs only as a script).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli to Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _setup_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_pycomm_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the functions; setup() needs __main__
    return module


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    return _setup_module()


def _checkout_files() -> list[str]:
    """The checkout's files as git sees them (tracked, and untracked ones not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The sdist's files, by path under its top folder."""
    tmp = tmp_path_factory.mktemp("sdist")
    tree, out = tmp / "tree", tmp / "dist"
    for rel in _checkout_files():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tree / rel)
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out)],
        cwd=tree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        "python -m build --sdist failed (the test extra installs `build`):\n"
        + proc.stdout[-3000:] + proc.stderr[-3000:])
    (archive,) = out.glob("pycomm-*.tar.gz")
    assert archive.name == f"pycomm-{VERSION}.tar.gz"
    files: dict[str, bytes] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            top, _, rel = member.name.partition("/")
            assert top == f"pycomm-{VERSION}", member.name
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[rel] = extracted.read()
    return files


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def included_headers(sources: list[str]) -> set[str]:
    """Every project header that the sources include, recursively (a quoted include
    resolves beside the including file, else under csrc/, as setup.py's -I csrc)."""
    seen: set[str] = set()
    todo = [ROOT / s for s in sources]
    while todo:
        path = todo.pop()
        for name in _INCLUDE.findall(path.read_text()):
            for base in (path.parent, CSRC):
                found = (base / name).resolve()
                if found.is_file() and found.is_relative_to(ROOT):
                    rel = found.relative_to(ROOT).as_posix()
                    if rel not in seen:
                        seen.add(rel)
                        todo.append(found)
                    break
    return seen


def test_sdist_holds_every_compiled_source_and_included_header(setup_py, sdist):
    compiled = setup_py.cpu_sources() + setup_py.cuda_sources()
    assert any(s.endswith(".cu") for s in compiled) and len(compiled) > 20, compiled
    headers = included_headers(compiled)
    assert "csrc/torch/backend.h" in headers and any(h.endswith(".cuh") for h in headers)
    missing = sorted(set(compiled) - set(sdist)) + sorted(headers - set(sdist))
    assert not missing, f"the sdist lacks files the build needs: {missing}"


def test_sdist_holds_licence_and_metadata(sdist):
    for name in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
                 "PKG-INFO"):
        assert name in sdist, name
    assert b"BSD 3-Clause License" in sdist["LICENSE"]
    info = sdist["PKG-INFO"].decode()
    assert f"\nVersion: {VERSION}\n" in info
    assert "\nLicense-Expression: BSD-3-Clause\n" in info
    assert "\nLicense-File: LICENSE\n" in info
    torch_req = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert f"\nRequires-Dist: {torch_req}\n" in info
    assert "Operating System :: POSIX :: Linux" in info


def test_sdist_installs_pycomm_and_parallel_not_bench(sdist):
    (top_level,) = [v for k, v in sdist.items() if k.endswith(".egg-info/top_level.txt")]
    assert set(top_level.decode().split()) == {"pycomm", "parallel"}
    assert not [f for f in sdist if f.startswith("bench/")]
    assert "pycomm/__init__.py" in sdist and "parallel/__init__.py" in sdist
    assert "entry_points.txt" not in " ".join(sdist), "no console script (bench is not shipped)"


def test_version_comes_from_the_installed_metadata():
    import importlib.metadata

    import pycomm

    try:
        installed = importlib.metadata.version("pycomm")
    except importlib.metadata.PackageNotFoundError:
        assert pycomm.__version__ == "0+unknown"
    else:
        assert pycomm.__version__ == installed == VERSION


# --- CUDA architecture flags (setup.py's nvcc_flags) ----------------------------------


def _gencode(flags: list[str]) -> list[str]:
    return [flags[i + 1] for i, f in enumerate(flags) if f == "-gencode"]


def _flags(setup_py, monkeypatch, pycomm_arch=None, torch_list=None) -> list[str]:
    for var, value in (("PYCOMM_CUDA_ARCH", pycomm_arch), ("TORCH_CUDA_ARCH_LIST", torch_list)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    return _gencode(setup_py.nvcc_flags())


def test_default_archs_embed_ptx_for_the_newest(setup_py, monkeypatch):
    assert _flags(setup_py, monkeypatch) == [
        "arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90",
        "arch=compute_90,code=compute_90"]


@pytest.mark.parametrize(("torch_list", "expected"), [
    ("8.0;9.0+PTX", ["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90",
                     "arch=compute_90,code=compute_90"]),
    ("8.0 9.0", ["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90"]),
    ("9.0a", ["arch=compute_90a,code=sm_90a"]),
    ("Hopper", ["arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"]),
    ("8.6;10.0+PTX", ["arch=compute_86,code=sm_86", "arch=compute_100,code=sm_100",
                      "arch=compute_100,code=compute_100"]),
])
def test_torch_cuda_arch_list_is_honoured(setup_py, monkeypatch, torch_list, expected):
    assert _flags(setup_py, monkeypatch, torch_list=torch_list) == expected


def test_pycomm_cuda_arch_wins_over_torch_cuda_arch_list(setup_py, monkeypatch):
    assert _flags(setup_py, monkeypatch, pycomm_arch="90", torch_list="8.0;8.6") == [
        "arch=compute_90,code=sm_90"]
    assert _flags(setup_py, monkeypatch, pycomm_arch="80,90+PTX") == [
        "arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90",
        "arch=compute_90,code=compute_90"]


@pytest.mark.parametrize("bad", ["sm_90", "9.0+ptx", ";"])
def test_unreadable_arch_list_is_an_error(setup_py, monkeypatch, bad):
    with pytest.raises(ValueError, match="CUDA architecture"):
        _flags(setup_py, monkeypatch, torch_list=bad)
