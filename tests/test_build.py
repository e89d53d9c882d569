"""What the build must deliver: vectorised reduction kernels, checked in the disassembly
of the very extension the tests load."""

from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.usefixtures("require_pycomm")


@functools.cache
def _objdump() -> str:
    """The demangled disassembly of pycomm._C (read once: it is the same for every case)."""
    from pycomm import _C

    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", _C.__file__],
        check=True, capture_output=True, text=True,
    ).stdout


def _disassembly(symbol: str, clone: str) -> str:
    """The instructions of one target clone of a kernel in pycomm._C."""
    head = rf"<pycomm::\(anonymous namespace\)::{symbol}\([^>]*\) \[clone \.{clone}\]>:"
    pattern = head + r"\n(.*?)\n\n"
    match = re.search(pattern, _objdump(), re.S)
    assert match, f"no [clone .{clone}] of {symbol} in pycomm._C"
    return match.group(1)


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="not x86-64: the kernels' ISA clones are x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
@pytest.mark.parametrize(
    ("symbol", "clone", "instruction"),
    [
        ("pair_f32", "arch_x86_64_v3", r"vaddps\s+.*%ymm"),   # AVX2: 8 floats per add
        ("pair_f32", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),   # AVX-512: 16 per add
        ("pair_bf16", "arch_x86_64_v3", r"vaddps\s+.*%ymm"),  # bf16 widened, added as f32
        ("pair_bf16", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),
        ("pair_f16", "arch_x86_64_v3", r"vaddps\s+.*%ymm"),  # half as bits, widened in lanes
        ("pair_f16", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),
        ("rc_f32", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),  # reduce_copy: k sources, n dsts
        ("rc_bf16", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),
        ("rc_f16", "arch_x86_64_v4", r"vaddps\s+.*%zmm"),
    ],
)
def test_sum_kernels_are_vectorised(symbol, clone, instruction):
    assert re.search(instruction, _disassembly(symbol, clone)), (
        f"{symbol} [{clone}] has no packed add matching {instruction!r}"
    )


def _function_disassembly(signature_start: str) -> str:
    """The instructions of a function of pycomm._C whose demangled name starts so."""
    match = re.search(rf"<{re.escape(signature_start)}[^>]*>:\n(.*?)\n\n", _objdump(), re.S)
    assert match, f"no {signature_start} in pycomm._C"
    return match.group(1)


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="not x86-64: F16C is an x86-64 instruction set")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
@pytest.mark.parametrize(
    ("function", "instructions"),
    [
        # float16's sum in registers: 8 halves widened, added as floats, narrowed
        ("void pycomm::(anonymous namespace)::sum_fixed<2, 1>(",
         [r"vcvtph2ps\s+.*%ymm", r"vaddps\s+.*%ymm", r"vcvtps2ph\s+"]),
        ("void pycomm::(anonymous namespace)::sum_fixed<4, 2>(",
         [r"vcvtph2ps\s+.*%ymm", r"vaddps\s+.*%ymm", r"vcvtps2ph\s+"]),
        ("pycomm::f16_to_float_block(", [r"vcvtph2ps\s+.*%ymm"]),
        ("pycomm::float_to_f16_block(", [r"vcvtps2ph\s+.*%ymm"]),
    ],
)
def test_float16_kernels_convert_with_f16c(function, instructions):
    """Built for every x86-64 CPU, the F16C kernels still hold the 8-wide instructions
    (their target attribute, not the build's flags, enables them)."""
    code = _function_disassembly(function)
    missing = [i for i in instructions if not re.search(i, code)]
    assert not missing, f"{function} lacks {missing}"


def test_the_extension_carries_no_debug_information():
    """-g0 unless PYCOMM_DEBUG_INFO=1 (setup.py): a wheel's pycomm._C is a few MB, not
    the ~70 MB that Python's -g made it (64 MB of DWARF)."""
    import os

    from pycomm import _C

    sections = subprocess.run(["objdump", "-h", _C.__file__], check=True, capture_output=True,
                              text=True).stdout
    if os.environ.get("PYCOMM_DEBUG_INFO") == "1":  # a build asked to keep it
        assert ".debug_info" in sections
        return
    assert ".debug_info" not in sections
    assert os.path.getsize(_C.__file__) < 20 << 20
