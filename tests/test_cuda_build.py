"""Every csrc/cuda/*.cu compiles with nvcc for sm_80 and sm_90, spilling nothing.

One case per file, both architectures in one nvcc call; ``-Xptxas -v`` reports each
kernel's registers (printed: ``pytest -rP tests/test_cuda_build.py``, and recorded as
the case's ``registers`` property) and spills, which must be 0. Needs nvcc, not a GPU.
The torch glue in csrc/torch/**/*.cu (host code only) is type-checked against this torch's
headers, so a CPU-only CI catches a broken CUDA build of pycomm._C too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
GLUE = sorted((ROOT / "csrc" / "torch").rglob("*.cu"))
ARCHS = ("80", "90")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if found is None and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        found = os.path.join(home, "bin", "nvcc")
    return found


def _demangle(names: list[str], nvcc: str) -> dict[str, str]:
    """Mangled -> readable, with cu++filt beside nvcc when there is one."""
    filt = shutil.which("cu++filt", path=str(Path(nvcc).parent)) or shutil.which("c++filt")
    if filt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True)
    readable = out.stdout.splitlines()
    return dict(zip(names, readable, strict=True)) if len(readable) == len(names) else {
        n: n for n in names}


def ptxas_report(text: str) -> list[dict]:
    """One row per (kernel, arch) that ptxas compiled: registers and spill bytes."""
    rows: list[dict] = []
    current: dict | None = None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line):
            current = {"kernel": m.group(1), "arch": m.group(2), "registers": None,
                       "spill_stores": None, "spill_loads": None}
            rows.append(current)
        elif (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) \
                and current is not None:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and current is not None:
            current["registers"] = int(m.group(1))
    return rows


def test_the_report_parser_reads_ptxas_output():
    text = """ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'
ptxas info    : Function properties for _Z1kPf
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 360 bytes cmem[0]"""
    assert ptxas_report(text) == [{"kernel": "_Z1kPf", "arch": "sm_90", "registers": 255,
                                   "spill_stores": 8, "spill_loads": 4}]


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_cuda_source_compiles_for_sm80_and_sm90_without_spills(source, tmp_path,
                                                                record_property):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (neither on PATH nor in $CUDA_HOME/bin)")
    gencode = [f for a in ARCHS for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    cmd = [nvcc, "-c", "-std=c++17", "-O3", *gencode, "-Xptxas", "-v",
           "-I", str(ROOT / "csrc"), str(source), "-o", str(tmp_path / f"{source.stem}.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"nvcc failed on {source.name}:\n{' '.join(cmd)}\n{log}"
    rows = ptxas_report(log)
    names = _demangle(sorted({r["kernel"] for r in rows}), nvcc)
    print(f"# {source.name}: ptxas, per kernel and arch")
    for r in rows:
        print(f"{r['arch']:<6} {r['registers']!s:>4} registers  {r['spill_stores']} B spill "
              f"stores  {r['spill_loads']} B spill loads  {names[r['kernel']]}")
    record_property("registers", {f"{names[r['kernel']]} {r['arch']}": r["registers"]
                                  for r in rows})
    spilling = [f"{names[r['kernel']]} ({r['arch']}): {r['spill_stores']} B stores, "
                f"{r['spill_loads']} B loads" for r in rows
                if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, f"{source.name}: kernels spill registers:\n" + "\n".join(spilling)
    assert all(r["registers"] is not None for r in rows), log


@pytest.mark.parametrize("source", GLUE, ids=[s.name for s in GLUE])
def test_torch_glue_type_checks_against_this_torch(source, tmp_path):
    nvcc = _nvcc()
    homes = [os.environ.get("CUDA_HOME", "/usr/local/cuda"), "/usr/local/cuda"]
    if nvcc is not None:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    cuda = next((Path(h) / "include" for h in homes
                 if (Path(h) / "include" / "cuda_runtime.h").exists()), None)
    if cuda is None or shutil.which("g++") is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h)" if cuda is None else "no g++")
    # g++ on host code is a quarter of nvcc's time; the glue launches no kernel itself.
    # The CPU wheel ships c10/cuda's headers but not the one its CMake generates.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    import torch.utils.cpp_extension as cpp

    includes = [f"-I{p}" for p in (tmp_path, *cpp.include_paths(), cuda,
                                   sysconfig.get_paths()["include"], ROOT / "csrc")]
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-DPYCOMM_CUDA",
           "-DTORCH_EXTENSION_NAME=_C", *includes, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{source.name} does not compile:\n{done.stderr[-4000:]}"
