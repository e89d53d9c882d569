"""The torch glue of the CUDA path (compiled only in CUDA builds) type-checks against
this torch's headers and the CUDA toolkit's, so a CPU-only CI still catches a broken
CUDA build. (The kernels themselves: tests/test_cuda_build.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GLUE = ["csrc/torch/backend/backend.cc", "csrc/torch/backend/backend_collectives.cc",
        "csrc/torch/backend/tensor_args.cc", "csrc/torch/cuda/cuda_collectives.cc",
        "csrc/torch/cuda/cuda_host.cc"]


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    return next((c for c in candidates if (c / "cuda_runtime.h").exists()), None)


@pytest.mark.parametrize("source", GLUE)
def test_cuda_glue_type_checks(source, tmp_path):
    cuda = _cuda_include()
    if cuda is None or shutil.which("g++") is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h)" if cuda is None else "no g++")
    # The CPU wheel ships c10/cuda's headers but not the one its CMake generates.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    torch_inc = Path(torch.__file__).parent / "include"
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DPYCOMM_CUDA", f"-I{tmp_path}",
           f"-I{torch_inc}", f"-I{torch_inc / 'torch/csrc/api/include'}", f"-I{cuda}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'csrc'}", str(ROOT / source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) or done.stderr[-2000:]
