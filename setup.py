"""Builds pycomm._C: the torch-free core (csrc/core) and the c10d glue (csrc/torch).

CUDA sources (the kernels csrc/cuda/*.cu and their torch glue csrc/torch/*.cu) join the
build only when the installed torch has CUDA and nvcc is found; otherwise the build is
CPU-only and says so.
Build with `pip install --no-build-isolation .` so the torch you run is the torch we
compile against (the C++ ABI of c10d must match exactly).
"""

import glob
import os
import shutil

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# Sources include each other by their path under csrc/ ("core/transport/layout.h").
INCLUDE = os.path.join(ROOT, "csrc")


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT)
                  for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def cuda_wanted() -> bool:
    if os.environ.get("PYCOMM_NO_CUDA") == "1":
        return False
    import torch

    cu = sources("csrc/cuda/*.cu")
    has_nvcc = shutil.which("nvcc") is not None or cpp_extension.CUDA_HOME is not None
    return bool(cu) and torch.version.cuda is not None and has_nvcc


def nvcc_flags() -> list[str]:
    """sm_80 and sm_90 code unless PYCOMM_CUDA_ARCH says otherwise ("90", "80;90");
    PYCOMM_PTXAS_VERBOSE=1 prints each kernel's registers and spills."""
    archs = os.environ.get("PYCOMM_CUDA_ARCH", "80;90").replace(",", ";").split(";")
    flags = ["-O3", "-DPYCOMM_CUDA"]  # (torch adds its -std, c++20 for its headers)
    for arch in filter(None, (a.strip() for a in archs)):
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    if os.environ.get("PYCOMM_PTXAS_VERBOSE") == "1":
        flags += ["-Xptxas", "-v"]
    return flags


def extension():
    # -fno-trapping-math: nothing here relies on floating-point exceptions, and without
    # it GCC will not turn the clamps of the fused kernels' erf and exp into vector code.
    cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
                 "-fno-trapping-math"]
    # csrc/cuda/host is plain C++ (the CUDA ring's plan, simulator and handle format), so
    # CPU-only builds compile it too and CI tests it without a GPU.
    srcs = (sources("csrc/core/**/*.cc") + sources("csrc/recompute/*.cc")
            + sources("csrc/cuda/host/*.cc") + sources("csrc/torch/*.cc"))
    if cuda_wanted():
        print("pycomm: building with CUDA")
        return cpp_extension.CUDAExtension(
            "pycomm._C",
            srcs + sources("csrc/cuda/*.cu") + sources("csrc/torch/*.cu"),
            extra_compile_args={"cxx": cxx_flags + ["-DPYCOMM_CUDA"], "nvcc": nvcc_flags()},
            include_dirs=[INCLUDE],
        )
    print("pycomm: building the CPU-only extension (no CUDA torch or nvcc, or no CUDA sources)")
    return cpp_extension.CppExtension("pycomm._C", srcs, extra_compile_args={"cxx": cxx_flags},
                                      extra_link_args=["-lrt"], include_dirs=[INCLUDE])


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
