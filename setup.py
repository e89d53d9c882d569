"""Builds pycomm._C: the torch-free core (csrc/core) and the c10d glue (csrc/torch).

CUDA sources (the kernels csrc/cuda/*.cu and their torch glue csrc/torch/*.cu) join the
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

The setup() call runs only as a script (pip and setuptools run this file as __main__),
so tests import nvcc_flags() from it without building anything.
"""

import glob
import os
import re
import shutil

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
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
            + sources("csrc/cuda/host/*.cc") + sources("csrc/torch/*.cc"))


def cuda_sources() -> list[str]:
    """What a CUDA build compiles as well: the kernels and their torch glue."""
    return sources("csrc/cuda/*.cu") + sources("csrc/torch/*.cu")


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


def extension():
    # -fno-trapping-math: nothing here relies on floating-point exceptions, and without
    # it GCC will not turn the clamps of the fused kernels' erf and exp into vector code.
    cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
                 "-fno-trapping-math"]
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


if __name__ == "__main__":
    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    )
