"""Builds pycomm._C: the torch-free core (csrc/core) and the c10d glue (csrc/torch).

CUDA sources (the kernels csrc/cuda/*.cu and their torch glue csrc/torch/**/*.cu) join the
build only when the installed torch has CUDA and nvcc is found; otherwise the build is
CPU-only and says so.
Build with `pip install --no-build-isolation .` so the torch you run is the torch we
compile against (the C++ ABI of c10d must match exactly).

Environment:
  PYCOMM_NO_CUDA=1        build the CPU-only extension even where torch has CUDA and nvcc
                          is found (e.g. a CUDA torch wheel next to an nvcc of another
                          CUDA major version, which torch's extension builder refuses).
  PYCOMM_CUDA_ARCH        pycomm's own list of GPU architectures ("80;90", "90+PTX"); it
                          wins over
  TORCH_CUDA_ARCH_LIST    torch's convention ("8.0;9.0+PTX", "8.0 9.0", "Hopper"), used
                          when PYCOMM_CUDA_ARCH is unset. With neither: sm_80 and sm_90
                          code plus compute_90 PTX, which newer GPUs JIT-compile. "+PTX"
                          after an architecture embeds its PTX as well.
  PYCOMM_PTXAS_VERBOSE=1  ptxas prints each kernel's registers and spills.
  PYCOMM_DEBUG_INFO=1     keep debug information in pycomm._C (-g, as Python's CFLAGS
                          give it). Without it the build passes -g0: the extension is a
                          few MB instead of ~70 (64 of them DWARF), as wheels ship.

Requirements: a wheel (and an editable install) requires exactly the torch it was compiled
against (``torch==2.13.0``: its binary uses torch's C++ ABI, which changes with every
release); the sdist, which compiles on install, keeps the range ``torch>=TORCH_FLOOR``.

The setup() call runs only as a script (pip and setuptools run this file as __main__),
so tests import nvcc_flags() and torch_requirement() from it without building anything.
"""

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# The oldest torch pycomm builds against: the c10d glue overrides Backend::setTimeout,
# shutdown and abort and reads the options' asyncOp, which older torch lacks. CI's job 2
# installs the sdist against the newest 2.9.x (.ci/run reads the floor from this line).
TORCH_FLOOR = "2.9"
# Sources include each other by their path under csrc/ ("core/transport/layout.h").
INCLUDE = os.path.join(ROOT, "csrc")


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT)
                  for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def cpu_sources() -> list[str]:
    """What every build compiles. csrc/cuda/host is plain C++ (the CUDA ring's plan,
    simulator and handle format), so CPU-only builds compile it too and CI tests it
    without a GPU."""
    return (sources("csrc/core/**/*.cc") + sources("csrc/recompute/*.cc")
            + sources("csrc/cuda/host/*.cc") + sources("csrc/torch/**/*.cc"))


def cuda_sources() -> list[str]:
    """What a CUDA build compiles as well: the kernels and their torch glue."""
    return sources("csrc/cuda/*.cu") + sources("csrc/torch/**/*.cu")


def cuda_wanted() -> bool:
    if os.environ.get("PYCOMM_NO_CUDA") == "1":
        return False
    import torch

    cu = sources("csrc/cuda/*.cu")
    has_nvcc = shutil.which("nvcc") is not None or cpp_extension.CUDA_HOME is not None
    return bool(cu) and torch.version.cuda is not None and has_nvcc


# torch's names for architecture families (torch.utils.cpp_extension's table).
NAMED_ARCHS = {
    "Volta": "7.0+PTX", "Turing": "7.5+PTX", "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX", "Hopper": "9.0+PTX", "Blackwell+Tegra": "10.1",
    "Blackwell": "10.0;12.0+PTX",
}
DEFAULT_ARCHS = "80;90+PTX"


def gencode_flags(arch_list: str) -> list[str]:
    """nvcc -gencode flags for an architecture list in torch's TORCH_CUDA_ARCH_LIST form
    ("8.0;9.0+PTX", "8.0 9.0", "9.0a", "Hopper") or pycomm's ("80;90", "90+PTX"): sm_XX
    code for each, and compute_XX PTX as well for those marked +PTX."""
    for name, archs in NAMED_ARCHS.items():
        arch_list = arch_list.replace(name, archs)
    flags: list[str] = []
    for item in re.split(r"[;,\s]+", arch_list.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:\.(\d))?([af]?)(\+PTX)?", item)
        if m is None:
            raise ValueError(f"pycomm: cannot read CUDA architecture {item!r} in "
                             f"{arch_list!r} (write e.g. '8.0;9.0+PTX' or '80;90')")
        major, minor, suffix, ptx = m.groups()
        num = f"{major}{minor}{suffix}" if minor is not None else f"{major}{suffix}"
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    if not flags:
        raise ValueError(f"pycomm: no CUDA architecture in {arch_list!r}")
    return flags


def nvcc_flags() -> list[str]:
    """The GPU architectures from PYCOMM_CUDA_ARCH, else TORCH_CUDA_ARCH_LIST, else sm_80
    and sm_90 code plus compute_90 PTX (see the module docstring). torch adds no arch
    flags of its own once these -gencode flags are given."""
    archs = (os.environ.get("PYCOMM_CUDA_ARCH") or os.environ.get("TORCH_CUDA_ARCH_LIST")
             or DEFAULT_ARCHS)
    flags = ["-O3", "-DPYCOMM_CUDA"]  # (torch adds its -std, c++20 for its headers)
    flags += gencode_flags(archs)
    if os.environ.get("PYCOMM_PTXAS_VERBOSE") == "1":
        flags += ["-Xptxas", "-v"]
    return flags


def debug_info_flags() -> list[str]:
    """-g0 after Python's -g (the last one wins) unless PYCOMM_DEBUG_INFO=1."""
    return [] if os.environ.get("PYCOMM_DEBUG_INFO") == "1" else ["-g0"]


def extension():
    # -fno-trapping-math: nothing here relies on floating-point exceptions, and without
    # it GCC will not turn the clamps of the fused kernels' erf and exp into vector code.
    # No -std: torch's extension builder adds the standard its own headers are written
    # for (C++20 from torch 2.10; C++17 before), and a lower one warns on every header.
    cxx_flags = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
                 "-fno-trapping-math", *debug_info_flags()]
    srcs = cpu_sources()
    if cuda_wanted():
        print("pycomm: building with CUDA")
        return cpp_extension.CUDAExtension(
            "pycomm._C",
            srcs + cuda_sources(),
            extra_compile_args={"cxx": cxx_flags + ["-DPYCOMM_CUDA"], "nvcc": nvcc_flags()},
            include_dirs=[INCLUDE],
        )
    print("pycomm: building the CPU-only extension (no CUDA torch or nvcc, or no CUDA sources)")
    return cpp_extension.CppExtension("pycomm._C", srcs, extra_compile_args={"cxx": cxx_flags},
                                      extra_link_args=["-lrt"], include_dirs=[INCLUDE])


def build_dir() -> str:
    """Where the objects and ninja's state stay between builds: PYCOMM_BUILD_DIR, else
    build/ in the checkout, per Python and torch (objects of another torch never mix)."""
    import sysconfig

    import torch

    tag = f"{sysconfig.get_platform()}-py{sysconfig.get_python_version()}-torch{torch.__version__}"
    return os.environ.get("PYCOMM_BUILD_DIR") or os.path.join(ROOT, "build", f"temp.{tag}")


class IncrementalBuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build in a folder that outlives the build: `pip install -e .` (and
    `pip install .`) otherwise compile in a fresh temporary folder each time, so every
    install recompiled all of csrc/; here ninja recompiles only what changed."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = build_dir()

    def build_extension(self, ext) -> None:
        super().build_extension(ext)
        problem = cxx_runtime_problem(self.get_ext_fullpath(ext.name))
        if problem:
            raise SystemExit(problem)


def elf_needed(path: str) -> list[str] | None:
    """The shared libraries an ELF file names (DT_NEEDED), or None without readelf."""
    import subprocess

    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def cxx_runtime_problem(path: str) -> str | None:
    """Why the built extension would crash in torch's process, or None. It must load the
    C++ runtime (libstdc++.so or libc++.so) that torch loads: a compiler that links a
    private copy into it (a CXX wrapper adding -static-libstdc++, as one CUDA image's
    /opt/gcc/bin/g++ does) gives the process two C++ runtimes, and the extension's copy
    segfaults at its first stream insertion or exception, seen on a GPU machine. Without
    readelf this is not checked, and the build says so."""
    needed = elf_needed(path)
    if needed is None:
        print(f"pycomm: readelf not found: not checked that {path} loads libstdc++ dynamically")
        return None
    if any(lib.startswith(("libstdc++.so", "libc++.so")) for lib in needed):
        return None
    cxx = os.environ.get("CXX", "c++")
    return (f"pycomm: {os.path.basename(path)} does not load the C++ runtime as a shared "
            f"library (it needs only {', '.join(needed) or 'nothing'}): the compiler "
            f"(CXX={cxx}) linked its own copy of libstdc++ into it, and a second C++ runtime "
            "beside torch's crashes at the first exception or stream output. Build with a "
            "compiler that links libstdc++ dynamically, e.g. CXX=g++ CC=gcc pip install "
            "--no-build-isolation -e .")


def torch_requirement(building_sdist: bool) -> str:
    """The sdist's torch requirement is the range it compiles against (torch>=TORCH_FLOOR);
    a wheel's, and an editable install's, is the torch this build compiles against, without
    its local label (2.13.0+cpu -> torch==2.13.0, which a 2.13.0+cu128 satisfies too)."""
    if building_sdist:
        return f"torch>={TORCH_FLOOR}"
    import torch

    return f"torch=={str(torch.__version__).partition('+')[0]}"


def install_requires(argv: list[str]) -> list[str]:
    """pyproject.toml's dependencies are dynamic: they are these. setuptools' build_meta
    runs this file with argv [setup.py, "sdist", ...] for build_sdist, and with
    "egg_info", "dist_info", "bdist_wheel" or "editable_wheel" for the rest."""
    return [torch_requirement(building_sdist="sdist" in argv)]  # numpy: the ps extra


# The strategies are pycomm.parallel, kept in the checkout's top-level parallel/ folder:
# "parallel" alone is other distributions' import name (parallel-web installs one), and a
# wheel with two top-level packages of generic names overwrites theirs or is overwritten.
# pycomm_autoload is torch's entry point (pycomm/_torch_entry/__init__.py says why it is a
# top-level package of its own, and pyproject.toml's torch.backends entry names it).
PACKAGE_DIR = {"pycomm.parallel": "parallel", "pycomm.examples": "examples",
               "pycomm_autoload": "pycomm/_torch_entry"}


def packages() -> list[str]:
    """pycomm (the backend), pycomm.parallel's packages, the examples and pycomm_autoload,
    under their installed names."""
    return (find_packages(ROOT, include=["pycomm", "pycomm.*"], exclude=["pycomm._torch_entry"])
            + [f"pycomm.{p}" for p in find_packages(ROOT, include=["parallel", "parallel.*"])]
            + ["pycomm.examples", "pycomm_autoload"])


if __name__ == "__main__":
    setup(
        packages=packages(),
        package_dir=PACKAGE_DIR,
        # The planner's all-reduce table (written by
        # python -m pycomm.parallel.planner.refresh_collective_times)
        package_data={"pycomm.parallel.planner": ["data/*.json"],
                      "pycomm.examples": ["*.json", "*.toml"]},
        install_requires=install_requires(sys.argv),
        ext_modules=[extension()],
        cmdclass={"build_ext": IncrementalBuildExt},
    )
