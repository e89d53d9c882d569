"""Skip policy: a test may skip only because a named resource is missing.

A skip that does not name one (``No module named 'pycomm._C'``, "not built", "flaky")
is how a broken build turns a run green, so it fails the session: the exit status is
non-zero and the terminal summary lists every such test with its reason.

Allowed reasons start with the missing resource, as ``ALLOWED`` spells them ("no CUDA
GPU", "no nvcc ...", "no Open MPI ...", "not x86-64 ..."). Under ``--backend=gloo``
(``PYCOMM_TEST_BACKEND=gloo``) reasons starting with "gloo:" are allowed too: there the
backend under test is gloo, and pycomm-only tests skip saying so.

tests/conftest.py installs this plugin; ``pytest -p _skip_policy`` (with tests/ on
``PYTHONPATH``) installs it for any other test tree (tests/test_skip_policy.py does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

# resource -> pattern a skip reason for it must match (re.search; anchored at the start)
ALLOWED: dict[str, str] = {
    "CUDA GPU": r"^no CUDA (GPU|device)\b",
    "nvcc": r"^no nvcc\b",
    "CUDA toolkit": r"^no CUDA toolkit\b",
    "g++": r"^no g\+\+",
    "CuPy": r"^no CuPy\b",
    "DeepSpeed (a benchmark peer)": r"^no DeepSpeed\b",
    "Open MPI / mpi4py": r"^no (Open MPI|mpi4py|mpirun)\b",
    "network namespaces (ip netns)": r"^no network namespaces\b",
    "PID namespaces (unshare --pid)": r"^no PID namespaces\b",
    "root privileges": r"^no root\b",
    "a writable cgroup v1 memory controller": r"^no permission: cgroup v1 memory controller\b",
    "x86-64 CPU": r"^not x86-64\b",
    "F16C (the CPU's float16 conversions)": r"^no F16C\b",
    "a git checkout (an unpacked sdist)": r"^no git checkout\b",
    "objdump": r"^no objdump\b",
    "readelf": r"^no readelf\b",
    "strace": r"^no strace\b",
    "per-thread time slices (Linux >= 6.12)": r"^no per-thread time slices\b",
    "a torch API (older torch)": r"^no torch API\b",
    "transformers (the [hf] extra)": r"^no transformers\b",
    "Ray (the [ray] extra)": r"^no Ray\b",
    # pytest-benchmark's own skips, only when asked for on the command line
    "--benchmark-only / --benchmark-skip": r"\(--benchmark-(only|skip) active\)",
}
GLOO = r"^gloo: "  # allowed only when the backend under test is gloo
PLUGIN_NAME = "pycomm-skip-policy"
SHOWN_PER_REASON = 5  # test ids listed under each offending reason


def reason_allowed(reason: str, backend: str = "pycomm") -> bool:
    """Whether ``reason`` names a missing resource (see ``ALLOWED``)."""
    patterns = list(ALLOWED.values()) + ([GLOO] if backend == "gloo" else [])
    return any(re.search(p, reason) for p in patterns)


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr  # (file, line, "Skipped: why") for skips
    text = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    return text.removeprefix("Skipped: ")


@dataclass(eq=False)  # a plugin must be hashable
class SkipPolicy:
    backend: str
    skips: list[tuple[str, str]] = field(default_factory=list)  # (node id, reason)

    @property
    def offending(self) -> list[tuple[str, str]]:
        return [(node, why) for node, why in self.skips if not reason_allowed(why, self.backend)]

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is no skip
            self.skips.append((report.nodeid, _reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # module-level pytest.skip / importorskip

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.offending and session.exitstatus in (pytest.ExitCode.OK,
                                                     pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        bad = self.offending
        if not bad:
            return
        tr = terminalreporter
        tr.section("skip policy: skips that name no missing resource", sep="=", red=True)
        by_reason: dict[str, list[str]] = {}
        for node, why in bad:
            by_reason.setdefault(why, []).append(node)
        for why, nodes in by_reason.items():
            tr.write_line(f"SKIP WITHOUT A NAMED RESOURCE ({len(nodes)} tests): {why}", red=True)
            for node in nodes[:SHOWN_PER_REASON]:
                tr.write_line(f"    {node}")
            if len(nodes) > SHOWN_PER_REASON:
                tr.write_line(f"    ... and {len(nodes) - SHOWN_PER_REASON} more")
        tr.write_line("A test may skip only for a missing resource named at the start of its "
                      "reason: " + "; ".join(ALLOWED)
                      + (" (and 'gloo:' under --backend=gloo)" if self.backend != "gloo"
                         else "; 'gloo:'") + ". See tests/_skip_policy.py.")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """The very last line of the run, after pytest's counts, so a CI log ends with it."""
        bad = self.offending
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if bad and tr is not None:
            reasons = sorted({why for _, why in bad})
            tr.write_line(f"FAILED by the skip policy: {len(bad)} test(s) skipped for "
                          f"{len(reasons)} reason(s) that name no missing resource: "
                          + " | ".join(r[:200] for r in reasons[:3])
                          + (" | ..." if len(reasons) > 3 else ""), red=True, bold=True)


def install(config: pytest.Config) -> None:
    """Register the policy once per session (idempotent)."""
    if config.pluginmanager.has_plugin(PLUGIN_NAME):
        return
    backend = config.getoption("--backend", default="pycomm") or "pycomm"
    config.pluginmanager.register(SkipPolicy(str(backend)), PLUGIN_NAME)


def pytest_configure(config: pytest.Config) -> None:
    """Entry point for ``pytest -p _skip_policy``."""
    install(config)
