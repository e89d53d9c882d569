"""``python -m pycomm.env``: what pycomm sees on this machine (as DeepSpeed's ``ds_report``).

Prints the version and where it is installed, the torch the extension was built against
beside the one running, the toolchain and CPU kernels, /dev/shm against what a group of
``--ranks`` ranks needs, PID-namespace caveats and every ``PYCOMM_*`` variable. Exits 0,
or 1 when the extension cannot be loaded (the report says why; ``import pycomm`` itself
raises then, so run it as ``PYCOMM_ALLOW_NO_EXTENSION=1 python -m pycomm.env``).
``--json`` prints the same facts as one JSON object.

Example::

    python -m pycomm.env --ranks 8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import textwrap
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

import pycomm
from pycomm import islands
from pycomm._extension import load as _extension

MiB = 1 << 20

# Every variable pycomm reads, with its default (see csrc/core/base/config.h, log.h).
KNOWN_VARIABLES: dict[str, str] = {
    "PYCOMM_DEBUG": "WARN (INFO: init choices once per rank; TRACE: every op)",
    "PYCOMM_DEBUG_SUBSYS": "all (or some of INIT,COLL,P2P,SHM,ISLANDS; a leading ^ excludes)",
    "PYCOMM_DEBUG_FILE": "stderr (%h host, %p pid)",
    "PYCOMM_ALGO": "auto (ring | direct)",
    "PYCOMM_CHUNK_BYTES": "262144 (one slot's payload)",
    "PYCOMM_SLOTS": "64 (messages in flight per channel; 4 buffers at first)",
    "PYCOMM_DIRECT_BYTES": "4096, or 65536 with more ranks than cores (all_reduce of 3+: 4096)",
    "PYCOMM_ZERO_COPY": "1 (read arena tensors in place)",
    "PYCOMM_SPIN_US": "20, or 0 with more ranks than cores",
    "PYCOMM_YIELD_US": "1000",
    "PYCOMM_WAIT_SLICE_US": "100 (time slice a sleeping wait asks for; 0: the scheduler's)",
    "PYCOMM_STRIPES": "1 (communicators, each on its own thread, a large all_reduce is cut over)",
    "PYCOMM_STRIPE_BYTES": "4194304 (the least all_reduce striped)",
    "PYCOMM_TWO_SHOT_BYTES": "all sizes with more than two ranks, 0 with two (0: off)",
    "PYCOMM_TWO_SHOT_PIECE_BYTES": "524288 (what one two-shot round stages per rank)",
    "PYCOMM_TIMEOUT_S": "torch's default group timeout (1800)",
    "PYCOMM_LOCAL_SIZE": "unset (islands by host)",
    "PYCOMM_ARENA_SLAB_BYTES": "67108864 (arena slab)",
    "PYCOMM_CUDA_CHUNK_BYTES": "4194304 (CUDA ring slot)",
    "PYCOMM_CUDA_SLOTS": "4",
    "PYCOMM_CUDA_ARCH": "80;90+PTX (build time; else TORCH_CUDA_ARCH_LIST)",
    "PYCOMM_NO_CUDA": "unset (build time: 1 builds CPU-only)",
    "PYCOMM_PTXAS_VERBOSE": "unset (build time)",
    "PYCOMM_DEBUG_INFO": "unset (build time: 1 keeps debug information)",
    "PYCOMM_BUILD_DIR": "build/temp.<platform>-py<ver>-torch<ver> (build time: objects kept)",
    "PYCOMM_ALLOW_NO_EXTENSION": "unset (1: import pycomm without a loadable pycomm._C)",
    "PYCOMM_TEST_THREADS": "1 (torch threads in each rank pycomm.testing starts)",
}


# --- the extension and torch -------------------------------------------------------------


def load_extension() -> tuple[ModuleType | None, str | None]:
    """pycomm._C, or None and why it cannot be loaded."""
    try:
        return _extension(), None
    except RuntimeError as exc:
        return None, str(exc)


def base_version(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': what the headers record (no local tag)."""
    return version.split("+")[0]


def cuda_archs(ext: ModuleType) -> str:
    """The SM architectures the extension's CUDA kernels were built for, as it reports them."""
    if not ext.cuda_built():
        return "none (CPU-only build)"
    archs = getattr(ext, "cuda_archs", None)
    return format_archs(str(archs())) if archs is not None else "unknown"


def format_archs(arch_list: str) -> str:
    """nvcc's __CUDA_ARCH_LIST__ ('800,900') as 'sm_80, sm_90'."""
    archs = [a.strip() for a in arch_list.split(",") if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        return arch_list
    return ", ".join(f"sm_{int(a) // 10}" for a in archs)


def torch_section(ext: ModuleType | None) -> dict[str, Any]:
    running = torch.__version__
    out: dict[str, Any] = {"running": running, "cuda_runtime": torch.version.cuda,
                           "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
    if ext is None:
        return out
    built = ext.build_info()
    out.update(built_against=built["torch_version"], compiler=built["compiler"],
               extension_cxx11_abi=built["cxx11_abi"], cuda_built=bool(built["cuda"]),
               cuda_archs=cuda_archs(ext),
               cpu_kernels=f"{built['kernel_isa']}, float16 converted by "
                           f"{built.get('float16_conversion', '?')}")
    out["match"] = base_version(running) == built["torch_version"] and (
        built["cxx11_abi"] is None or built["cxx11_abi"] == out["cxx11_abi"])
    return out


def pycomm_section(ext: ModuleType | None, why: str | None) -> dict[str, Any]:
    return {"version": pycomm.__version__, "location": os.path.dirname(pycomm.__file__),
            "extension": ext.__file__ if ext is not None else None, "extension_error": why}


def platform_section() -> dict[str, Any]:
    """The machine as torch.utils.collect_env sees it (what torch's own bug reports
    give), beside what pycomm adds: the interpreter's path and the CPUs this process may
    run on (ranks share them)."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        info = _torch_env_info()
    except Exception as exc:  # collect_env runs tools (lscpu, gcc, nvidia-smi): any may fail
        out["collect_env"] = f"failed: {exc!r}"
        info = None
    if info is not None:
        out.update({"os": info.os, "libc": info.libc_version, "compiler": info.gcc_version,
                    "cpu": _cpu_model(info.cpu_info or ""), "gpus": info.nvidia_gpu_models,
                    "nvidia driver": info.nvidia_driver_version})
    out.update({"kernel": platform.release(), "cpus": os.cpu_count(),
                "cpus usable": len(os.sched_getaffinity(0))})
    return out


@functools.lru_cache(maxsize=1)
def _torch_env_info() -> Any:
    from torch.utils import collect_env

    return collect_env.get_env_info()


def _cpu_model(lscpu: str) -> str:
    """lscpu's "Model name" line (collect_env's cpu_info is lscpu's whole output)."""
    for line in lscpu.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "?"


# --- /dev/shm ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShmNeed:
    """Bytes of /dev/shm one group of ``ranks`` takes (its segments, one per stripe of
    PYCOMM_STRIPES; see transport/layout.h)."""

    ranks: int
    at_init: int  # reserved when the group is created
    ring: int  # plus the one channel per rank a ring or chain uses, and two-shot stages
    every_channel: int  # plus all_to_all / send-recv between every pair, both lanes


def shm_need(ext: ModuleType, ranks: int) -> ShmNeed:
    seg = ext._segment_bytes(ranks)
    # A ring or chain's channel per rank, and the two-shot's stage areas.
    per_rank = seg["channel"] + seg["stage"]
    ring = seg["eager"] + ranks * per_rank if ranks > 1 else seg["eager"]
    stripes = seg["stripes"]
    return ShmNeed(ranks, stripes * seg["eager"], stripes * ring, stripes * seg["total"])


def check_shm(size: int, free: int, need: ShmNeed) -> list[str]:
    """Warnings about a /dev/shm of ``size`` bytes with ``free`` left, for ``need``."""
    fix = ("enlarge it: docker run --shm-size=1g ..., or in Kubernetes mount an emptyDir "
           "with medium: Memory at /dev/shm; or lower PYCOMM_CHUNK_BYTES / PYCOMM_SLOTS")
    if free < need.ring:
        return [f"/dev/shm is too small: a group of {need.ranks} ranks needs {mib(need.ring)} "
                f"for ring collectives but {mib(free)} of {mib(size)} is free; {fix}"]
    if free < need.every_channel:
        return [f"/dev/shm has {mib(free)} free of {mib(size)}: enough for ring collectives of "
                f"{need.ranks} ranks ({mib(need.ring)}), not for all_to_all or send/recv "
                f"between every pair ({mib(need.every_channel)}); {fix}"]
    return []


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def shm_section(ext: ModuleType | None, ranks: int) -> dict[str, Any]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return {"error": f"/dev/shm: {exc}", "warnings": [f"/dev/shm cannot be read: {exc}"]}
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    out: dict[str, Any] = {"size": size, "free": free, "ranks": ranks}
    if ext is not None:
        need = shm_need(ext, ranks)
        out.update(need=asdict(need), warnings=check_shm(size, free, need))
    return out


# --- namespaces --------------------------------------------------------------------------


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def nspids(status_text: str) -> list[int]:
    """This process's pid in each PID namespace it is in, outermost first (NSpid)."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def namespace_section() -> dict[str, Any]:
    try:
        with open("/proc/self/status") as f:
            pids = nspids(f.read())
    except OSError:
        pids = []
    own, init = _link("/proc/self/ns/pid"), _link("/proc/1/ns/pid")
    nested = len(pids) > 1 or (own is not None and init is not None and own != init)
    return {"pid_ns": own, "ipc_ns": _link("/proc/self/ns/ipc"), "nspid": pids,
            "nested_pid_ns": nested, "host_key": islands.host_key()}


NAMESPACE_NOTE = (
    "Each rank records the inode of its PID namespace in the group's segment. Zero-copy "
    "(reading a peer's arena tensor in place through /proc/<pid>/fd) needs every rank in one "
    "PID namespace: ranks in different ones fall back to copying through the segment "
    "(PYCOMM_DEBUG=TRACE says 'the ranks are in different PID namespaces'). A dead peer is "
    "still seen at once (liveness is a file lock on the segment, not a pid). Ranks share "
    "memory only with ranks of the same host key (host name, boot id, /dev/shm, network "
    "namespace); others are separate islands, joined over gloo.")


# --- variables ---------------------------------------------------------------------------


def variables_section(environ: dict[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    in_effect = {k: v for k, v in sorted(env.items()) if k.startswith("PYCOMM_")}
    unknown = sorted(set(in_effect) - set(KNOWN_VARIABLES))
    return {"set": in_effect, "known": KNOWN_VARIABLES, "unknown": unknown}


# --- the report --------------------------------------------------------------------------


def collect(ranks: int) -> dict[str, Any]:
    ext, why = load_extension()
    return {"pycomm": pycomm_section(ext, why), "torch": torch_section(ext),
            "platform": platform_section(), "shm": shm_section(ext, ranks),
            "namespaces": namespace_section(), "variables": variables_section()}


def warnings_of(report: dict[str, Any]) -> list[str]:
    out = list(report["shm"].get("warnings", []))
    t = report["torch"]
    if t.get("match") is False:
        out.append(f"pycomm._C was built against torch {t['built_against']} (C++11 ABI "
                   f"{t['extension_cxx11_abi']}) but torch {t['running']} (C++11 ABI "
                   f"{t['cxx11_abi']}) is running: rebuild with pip install --no-build-isolation .")
    out += [f"{name} is not a variable pycomm reads (a typo?)"
            for name in report["variables"]["unknown"]]
    return out


def _lines(title: str, rows: dict[str, Any]) -> list[str]:
    width = max((len(k) for k in rows), default=0)
    return [title, *(f"  {k:<{width}}  {v}" for k, v in rows.items()), ""]


def render(report: dict[str, Any]) -> str:
    p, t, s, ns = report["pycomm"], report["torch"], report["shm"], report["namespaces"]
    out = _lines("pycomm", {"version": p["version"], "location": p["location"],
                            "extension": p["extension"] or f"NOT LOADED: {p['extension_error']}"})
    torch_rows = {"running": t["running"], "built against": t.get("built_against", "?"),
                  "compiler": t.get("compiler", "?"),
                  "C++11 ABI": f"torch {t['cxx11_abi']}, pycomm {t.get('extension_cxx11_abi')}",
                  "CUDA": f"torch {t['cuda_runtime'] or 'none'}, pycomm built "
                          f"{t.get('cuda_built')}, archs {t.get('cuda_archs', '?')}",
                  "CPU kernels": t.get("cpu_kernels", "?")}
    out += _lines("torch", torch_rows)
    out += _lines("platform", report["platform"])
    shm_rows: dict[str, Any] = {"size": mib(s.get("size", 0)), "free": mib(s.get("free", 0))}
    if "need" in s:
        need = s["need"]
        shm_rows[f"need ({s['ranks']} ranks)"] = (
            f"{mib(need['at_init'])} at init, {mib(need['ring'])} with ring channels, "
            f"{mib(need['every_channel'])} with every channel")
        shm_rows["note"] = ("per group: each new_group takes its own; arena tensors "
                            "(pycomm.empty) live in memfd, not /dev/shm")
    out += _lines("/dev/shm", shm_rows)
    ns_rows = {"PID namespace": ns["pid_ns"], "nested": ns["nested_pid_ns"],
               "NSpid": " ".join(map(str, ns["nspid"])), "IPC namespace": ns["ipc_ns"],
               "host key": ns["host_key"]}
    note = textwrap.wrap(NAMESPACE_NOTE, 86, initial_indent="  ", subsequent_indent="  ")
    out += _lines("namespaces", ns_rows) + note + [""]
    v = report["variables"]
    out += _lines("PYCOMM_* in effect", v["set"] or {"(none)": ""})
    out += _lines("PYCOMM_* known (default)", v["known"])
    out += [f"WARN {w}" for w in warnings_of(report)]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycomm.env",
                                     description="What pycomm sees on this machine.")
    parser.add_argument("--ranks", type=int, default=min(8, os.cpu_count() or 8),
                        help="ranks per host to size /dev/shm for (default: min(8, CPUs))")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, not {args.ranks}")
    report = collect(args.ranks)
    if args.json:
        print(json.dumps({**report, "warnings": warnings_of(report)}, indent=2, default=str))
    else:
        print(render(report), end="")
    return 0 if report["pycomm"]["extension"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
