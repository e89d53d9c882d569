"""What pycomm ships: the sdist, the version, its requirements and index metadata, the
CUDA architecture flags, the incremental build folder, and the error of a pycomm whose
extension does not load.

The sdist is built here (``python -m build --sdist --no-isolation``, from a copy of the
checkout so the build writes nothing into it) and read, not compiled: it must hold every
source setup.py compiles (the CPU and the CUDA build's), every header they include,
recursively, and LICENSE, README.md, pyproject.toml and setup.py; its packages are
pycomm and pycomm.parallel (the parallel/ folder), never bench (which runs from a
checkout). That the sdist then installs and works is the test that CI's second job
does: it installs it with pip into a fresh virtual environment with the oldest supported
torch and runs the backend and conformance tests against that install (.ci/run, "job 2").
Fast: no compiler runs here.

nvcc_flags(), torch_requirement() and IncrementalBuildExt are imported from setup.py (its
setup() call runs only as a script).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote, urlparse

import pytest
import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli to Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DISTRIBUTION = PYPROJECT["project"]["name"]


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
    (archive,) = out.glob("pycomm_collectives-*.tar.gz")  # the distribution's name
    assert archive.name == f"pycomm_collectives-{VERSION}.tar.gz"
    files: dict[str, bytes] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            top, _, rel = member.name.partition("/")
            assert top == f"pycomm_collectives-{VERSION}", member.name
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
    assert "csrc/torch/backend/backend.h" in headers and any(h.endswith(".cuh") for h in headers)
    missing = sorted(set(compiled) - set(sdist)) + sorted(headers - set(sdist))
    assert not missing, f"the sdist lacks files the build needs: {missing}"


def test_sdist_holds_licence_and_metadata(setup_py, sdist):
    for name in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
                 "PKG-INFO"):
        assert name in sdist, name
    assert b"BSD 3-Clause License" in sdist["LICENSE"]
    info = sdist["PKG-INFO"].decode()
    assert f"\nVersion: {VERSION}\n" in info
    assert "\nLicense-Expression: BSD-3-Clause\n" in info
    assert "\nLicense-File: LICENSE\n" in info
    # The sdist compiles on install, against any torch from the floor on: a range. Its
    # requires.txt (which setuptools reads back when building from it) says the same.
    assert setup_py.TORCH_FLOOR == "2.9"
    assert "\nRequires-Dist: torch>=2.9\n" in info, info
    assert "Requires-Dist: torch==" not in info
    (requires,) = [v for k, v in sdist.items() if k.endswith(".egg-info/requires.txt")]
    assert requires.decode().splitlines()[:2] == ["torch>=2.9", ""]  # then the extras
    assert "Operating System :: POSIX :: Linux" in info


def test_sdist_installs_names_of_our_own_and_not_bench(sdist):
    """Import names of our own: the strategies (the checkout's parallel/ folder) install as
    pycomm.parallel, never as a top-level ``parallel`` that other distributions own; beside
    pycomm only torch's entry point, pycomm_autoload (pycomm/_torch_entry says why)."""
    (top_level,) = [v for k, v in sdist.items() if k.endswith(".egg-info/top_level.txt")]
    assert sorted(top_level.decode().split()) == ["pycomm", "pycomm_autoload"]
    (sources,) = [v for k, v in sdist.items() if k.endswith(".egg-info/SOURCES.txt")]
    assert "parallel/train/loop.py" in sources.decode().split()
    assert not [f for f in sdist if f.startswith(("bench/", "records/"))]
    assert "pycomm/__init__.py" in sdist and "parallel/__init__.py" in sdist
    # the examples install as pycomm.examples, their data files with them
    assert {"examples/__init__.py", "examples/train_ddp.py", "examples/mixtral-tiny.json",
            "examples/train_gpt.toml", "pycomm/_torch_entry/__init__.py"} <= set(sdist)
    (entry_points,) = [v for k, v in sdist.items() if k.endswith(".egg-info/entry_points.txt")]
    assert entry_points.decode().split() == [
        "[console_scripts]", "pycomm-env", "=", "pycomm.env:main", "pycomm-plan", "=",
        "pycomm.parallel.planner.__main__:main", "pycomm-train", "=",
        "pycomm.parallel.train.launch:main", "[torch.backends]", "pycomm", "=",
        "pycomm_autoload:register_lazily"]


def test_pycomm_is_installed_and_imported_from_where_its_metadata_points():
    """The README installs pycomm (editable) before running the tests: its metadata must
    be found, say pyproject's version, and describe the very pycomm that is imported (an
    editable install of this checkout, or files installed where it is), not another copy."""
    import pycomm

    dist = importlib.metadata.distribution(DISTRIBUTION)  # PackageNotFoundError: not installed
    assert dist.version == VERSION
    assert pycomm.__version__ == VERSION
    package = Path(pycomm.__file__).resolve().parent
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        url = urlparse(direct["url"])
        assert url.scheme == "file" and Path(unquote(url.path)).resolve() == package.parent, (
            f"pycomm's editable install points at {direct['url']}, but {package} is imported")
    else:
        assert "pycomm/__init__.py" in {str(f) for f in dist.files or []}
        assert Path(str(dist.locate_file("pycomm/__init__.py"))).resolve() == (
            package / "__init__.py")
    from pycomm import _install

    assert _install.describes(dist, package) and _install.distribution() is not None


# --- requirements: a wheel pins the torch it was compiled against, the sdist a range -----


def _public(version: str) -> str:
    return version.partition("+")[0]


def test_installed_pycomm_pins_the_running_torch():
    """An editable install (as a wheel) requires exactly the torch it was built against;
    the tests run on that torch (a rebuild against another torch re-pins it)."""
    requires = importlib.metadata.requires(DISTRIBUTION) or []
    torch_reqs = [r for r in requires if r.startswith("torch") and "extra ==" not in r]
    assert torch_reqs == [f"torch=={_public(torch.__version__)}"], requires
    assert "numpy" not in requires  # the ps extra's: the backend runs without it
    assert 'numpy; extra == "ps"' in requires
    from pycomm import _install

    assert _install.built_against() == _public(torch.__version__)


@pytest.mark.parametrize(("version", "pin"), [
    ("2.13.0+cpu", "torch==2.13.0"), ("2.11.0+cu128", "torch==2.11.0"),
    ("2.9.1", "torch==2.9.1"), ("2.14.0a0+git1234567", "torch==2.14.0a0")])
def test_torch_requirement_pins_a_wheel_and_ranges_an_sdist(setup_py, monkeypatch, version, pin):
    monkeypatch.setattr(torch, "__version__", version)
    assert setup_py.torch_requirement(building_sdist=False) == pin
    assert setup_py.torch_requirement(building_sdist=True) == f"torch>={setup_py.TORCH_FLOOR}"
    # The argv that setuptools.build_meta gives setup.py for each hook.
    sdist = ["setup.py", "sdist", "--formats", "gztar", "--dist-dir", "/tmp/x"]
    assert setup_py.install_requires(sdist) == ["torch>=2.9"]
    for command in ("egg_info", "dist_info", "bdist_wheel", "editable_wheel"):
        assert setup_py.install_requires(["setup.py", command, "--dist-dir", "/tmp/x"]) == [
            pin], command


def test_dependencies_are_setup_pys():
    assert "dependencies" not in PYPROJECT["project"]
    assert PYPROJECT["project"]["dynamic"] == ["dependencies"]


# --- what a package index shows ----------------------------------------------------------

REPO_URL = "https://github.com/pycomm/pycomm"


def test_index_metadata_has_project_urls_and_classifiers():
    project = PYPROJECT["project"]
    assert project["urls"] == {
        "Homepage": REPO_URL, "Documentation": f"{REPO_URL}/tree/main/docs",
        "Source": REPO_URL, "Issues": f"{REPO_URL}/issues"}
    classifiers = set(project["classifiers"])
    floor = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert floor is not None
    assert {f"Programming Language :: Python :: 3.{minor}"
            for minor in range(int(floor.group(1)), 14)} <= classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert any(c.startswith("Intended Audience :: ") for c in classifiers)
    # The licence is the SPDX expression (setuptools >= 77 refuses License :: beside it).
    assert project["license"] == "BSD-3-Clause"
    assert not any(c.startswith("License ::") for c in classifiers)
    # The installed metadata (what a wheel carries) says the same.
    meta = importlib.metadata.metadata(DISTRIBUTION)
    assert f"Homepage, {REPO_URL}" in (meta.get_all("Project-URL") or [])
    assert "Programming Language :: Python :: 3.13" in (meta.get_all("Classifier") or [])


# --- the build folder outlives the build (setup.py's IncrementalBuildExt) -----------------


def test_incremental_build_ext_builds_in_build_dir(setup_py, monkeypatch, tmp_path):
    from setuptools import Distribution

    dist = Distribution({"name": DISTRIBUTION, "ext_modules": []})
    monkeypatch.delenv("PYCOMM_BUILD_DIR", raising=False)
    cmd = setup_py.IncrementalBuildExt(dist)
    cmd.ensure_finalized()
    assert cmd.build_temp == setup_py.build_dir()
    assert Path(cmd.build_temp).parent == ROOT / "build"
    assert f"torch{torch.__version__}" in Path(cmd.build_temp).name
    monkeypatch.setenv("PYCOMM_BUILD_DIR", str(tmp_path / "objects"))
    cmd = setup_py.IncrementalBuildExt(dist)
    cmd.ensure_finalized()
    assert cmd.build_temp == str(tmp_path / "objects")


# --- a pycomm whose extension does not load -----------------------------------------------


def _copy_without_extension(dest: Path, checkout: bool) -> Path:
    """A copy of the pycomm package under ``dest`` without _C*.so (and, for a checkout,
    with setup.py, pyproject.toml and csrc/ beside it)."""
    shutil.copytree(ROOT / "pycomm", dest / "pycomm",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    if checkout:
        for name in ("setup.py", "pyproject.toml"):
            shutil.copy2(ROOT / name, dest / name)
        (dest / "csrc").mkdir()
    return dest


def _import_pycomm(path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYCOMM_ALLOW_NO_EXTENSION"}
    # Without torch's entry point: the installed metadata names pycomm_autoload, which the
    # copy lacks, and torch fails its own import on an entry point it cannot load.
    environ.update(PYTHONPATH=str(path), TORCH_DEVICE_BACKEND_AUTOLOAD="0", **env)
    # Without the editable install's finder, which would find this checkout's pycomm._C
    # for the copy's package too.
    code = textwrap.dedent("""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
        import pycomm
        print("IMPORTED", pycomm.__file__, pycomm.extension_error() is not None)
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=path, env=environ,
                          capture_output=True, text=True, timeout=120)


def _fake_install(site: Path, torch_pin: str) -> None:
    """Installed metadata for the pycomm under ``site``, pinning ``torch_pin``."""
    info = site / f"pycomm_collectives-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {DISTRIBUTION}\n"
                                   f"Version: {VERSION}\n"
                                   f"Requires-Dist: torch=={torch_pin}\n")
    (info / "RECORD").write_text("pycomm/__init__.py,,\n")


def test_import_without_extension_in_a_checkout_says_how_to_build(tmp_path):
    root = _copy_without_extension(tmp_path / "checkout", checkout=True)
    proc = _import_pycomm(root)
    assert proc.returncode != 0 and "IMPORTED" not in proc.stdout
    err = proc.stderr
    assert "ImportError: pycomm: the C++ extension pycomm._C cannot be loaded: " in err
    assert "No module named 'pycomm._C'" in err  # the original ImportError
    assert f"torch {torch.__version__} is running" in err
    assert "a torch that is not recorded" in err  # this copy has no installed metadata
    assert f"source checkout ({root})" in err
    assert f"cd {root} && pip install --no-build-isolation -e ." in err


def test_import_without_extension_in_an_installed_copy_says_how_to_reinstall(tmp_path):
    site = _copy_without_extension(tmp_path / "site", checkout=False)
    _fake_install(site, "2.10.0")
    proc = _import_pycomm(site)
    assert proc.returncode != 0 and "IMPORTED" not in proc.stdout
    err = proc.stderr
    assert "No module named 'pycomm._C'" in err
    assert f"torch {torch.__version__} is running; pycomm was built against torch 2.10.0" in err
    assert f"installed copy ({site / 'pycomm'})" in err
    assert ("pip install --no-build-isolation --force-reinstall --no-deps --no-binary "
            f"{DISTRIBUTION} {DISTRIBUTION}") in err
    assert "pip install torch==2.10.0" in err
    assert "--no-build-isolation -e ." not in err


def test_allow_no_extension_imports_and_says_why_later(tmp_path):
    root = _copy_without_extension(tmp_path / "checkout", checkout=True)
    proc = _import_pycomm(root, PYCOMM_ALLOW_NO_EXTENSION="1")
    assert proc.returncode == 0, proc.stderr
    assert f"IMPORTED {root / 'pycomm' / '__init__.py'} True" in proc.stdout


def test_built_tree_imports_and_reports_no_extension_error():
    import pycomm

    assert pycomm.extension_error() is None


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


# The C++ runtime: one CUDA image's CXX (/opt/gcc/bin/g++) links libstdc++ statically; the
# extension then carried its own copy beside torch's and segfaulted at its first exception
# or stream insertion (std::ostream inside encode_ipc_info, on an H200). The build refuses
# such a link, naming the compiler.
NO_READELF = shutil.which("readelf") is None


@pytest.mark.skipif(NO_READELF, reason="no readelf (binutils)")
def test_the_built_extension_loads_the_cxx_runtime_dynamically(setup_py):
    from pycomm import _C  # type: ignore[attr-defined]

    assert setup_py.cxx_runtime_problem(_C.__file__) is None, setup_py.elf_needed(_C.__file__)


def _tiny_cxx_library(tmp_path: Path, *flags: str) -> str:
    src = tmp_path / "tiny.cc"
    src.write_text('#include <sstream>\nstd::string f(long x) { std::ostringstream s; s << x; '
                   'return s.str(); }\n')
    out = tmp_path / f"tiny{len(flags)}.so"
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True)
    return str(out)


@pytest.mark.skipif(NO_READELF, reason="no readelf (binutils)")
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_a_private_copy_of_the_cxx_runtime_is_refused_naming_the_compiler(setup_py, tmp_path,
                                                                          monkeypatch):
    assert setup_py.cxx_runtime_problem(_tiny_cxx_library(tmp_path)) is None
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    problem = setup_py.cxx_runtime_problem(_tiny_cxx_library(tmp_path, "-static-libstdc++"))
    assert problem is not None
    assert "CXX=/opt/gcc/bin/g++" in problem and "libstdc++" in problem, problem
    assert "tiny1.so does not load the C++ runtime as a shared library" in problem


def test_the_build_checks_the_cxx_runtime_of_what_it_linked(setup_py):
    """The check runs on every build: IncrementalBuildExt calls it after each extension."""
    import inspect

    assert "cxx_runtime_problem" in inspect.getsource(setup_py.IncrementalBuildExt.build_extension)


# --- the distribution's name: pip's "pycomm" is another project ---------------------------


INSTALL = re.compile(r"pip install\s+([^\n`)]+)")
# an installed-metadata lookup by the name that is not this project's
LOOKUP = re.compile(r"(?:version|distribution|requires|metadata|files)\(\s*[\"']pycomm[\"']")


def test_every_install_command_names_this_distribution():
    """Every ``pip install`` in the docs, messages and scripts that names this project
    names its own distribution (``pycomm-collectives``), and no code looks up installed
    metadata by the name ``pycomm``: PyPI's ``pycomm`` is a PLC communication library
    (1.0.8, which also installs a top-level ``pycomm``)."""
    wrong = []
    for rel in _checkout_files():
        a_record = rel.startswith("records/") and rel.count("/") > 1 and not rel.startswith(
            "records/investigations/")  # a kept run's files, as they ran
        if a_record or not rel.endswith((".md", ".py", ".toml", ".sh", "run")):
            continue
        for line_no, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines()):
            for args in INSTALL.findall(line):
                for token in args.split():
                    name = re.match(r"[\"']?([A-Za-z0-9_.-]+)", token)
                    if name is None or token.startswith(("-", ".", "/")):
                        continue
                    normal = re.sub(r"[-_.]+", "-", name.group(1)).lower()
                    if normal.startswith("pycomm") and normal != DISTRIBUTION:
                        wrong.append(f"{rel}:{line_no + 1}: {line.strip()}")
            if LOOKUP.search(line):
                wrong.append(f"{rel}:{line_no + 1}: {line.strip()}")
    assert not wrong, "\n".join(wrong)
    from pycomm.parallel import _optional

    assert _optional.DISTRIBUTION == DISTRIBUTION
    assert f"'{DISTRIBUTION}[ps]'" in _optional.install_command("zmq")


def test_the_planner_ships_its_collective_table(sdist):
    """An installed planner reads the all-reduce table shipped with it (not the benchmark's
    records, which are not installed); the table is the committed summaries' (refreshed
    by ``python -m pycomm.parallel.planner.refresh_collective_times records/collectives``)."""
    from pycomm.parallel.planner.collective_times import SHIPPED, CommModel

    assert "parallel/planner/data/all_reduce.json" in sdist
    assert sdist["parallel/planner/data/all_reduce.json"] == SHIPPED.read_bytes()
    assert CommModel().tables == CommModel(ROOT / "records" / "collectives").tables
