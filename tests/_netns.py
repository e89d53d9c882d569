"""Two "hosts" on one machine: network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2, nothing routed), for the tests that must cross a real network boundary."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (the skip reason), or None."""
    if shutil.which("ip") is None:
        return "no network namespaces: no `ip` command (iproute2)"
    probe = subprocess.run(["ip", "netns", "add", "pycomm-probe"], capture_output=True)
    if probe.returncode:
        return f"no network namespaces: `ip netns add` failed: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", "pycomm-probe"], check=False)
    return None


@contextlib.contextmanager
def two_hosts(tag: str) -> Iterator[tuple[str, str]]:
    """The two namespaces' names (deleted on exit, whatever happened)."""
    # Unique names: a namespace left by a killed run, or a concurrent run, cannot clash.
    ns = (f"pycomm-{tag}-{os.getpid()}-a", f"pycomm-{tag}-{os.getpid()}-b")
    sh = lambda *a: subprocess.run(a, check=True)  # noqa: E731
    try:
        for name in ns:
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "link", "add", "pcveth0", "netns", ns[0], "type", "veth", "peer", "name",
           "pcveth0", "netns", ns[1])
        for i, name in enumerate(ns):
            sh("ip", "-n", name, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "pcveth0")
            sh("ip", "-n", name, "link", "set", "pcveth0", "up")
        yield ns
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], check=False)


def in_namespace(ns: str, env: dict[str, str], argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` inside ``ns`` with exactly ``env``."""
    return ["ip", "netns", "exec", ns, "env", "-i", *[f"{k}={v}" for k, v in env.items()],
            *argv]
