"""Every test that depends on wall-clock time is listed in ``tests/timing_sensitive.txt``,
which CI runs again beside CPU-bound loops (issue 61: a suite that fails on a busy
machine is one people learn to ignore). The scan is :mod:`_timing_scan`."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from _timing_scan import TESTS, listed, scan


def test_every_test_that_depends_on_time_is_listed():
    unlisted = sorted(set(scan()) - set(listed()))
    assert not unlisted, (
        "these tests assert on wall-clock time but are not in tests/timing_sensitive.txt, "
        "so CI never runs them on a busy machine: make them wait on events (or derive "
        "the bound from a timeout or a measured baseline), then list each with what its "
        f"time assertion is: {unlisted}")


def test_every_listed_test_exists():
    """A renamed or deleted test must leave the list too (it would run nothing)."""
    missing = []
    for node_id in listed():
        path, _, name = node_id.partition("::")
        file = TESTS.parent / path
        defined = file.is_file() and any(
            isinstance(n, ast.FunctionDef) and n.name == name
            for n in ast.walk(ast.parse(file.read_text())))
        if not defined:
            missing.append(node_id)
    assert not missing, f"tests/timing_sensitive.txt lists tests that do not exist: {missing}"


def test_the_scan_finds_each_way_a_test_reads_the_clock(tmp_path: Path):
    """A clock in the assert, a duration kept in a variable, one a rank helper returns
    (also through a list it appends to), and a helper that asserts on time itself are
    found; an assert on no clock is not."""
    (tmp_path / "_helpers.py").write_text(textwrap.dedent("""
        import time

        def waited():
            out = []
            start = time.monotonic()
            out.append(time.monotonic() - start)
            return out

        def checks_itself():
            t0 = time.perf_counter()
            assert time.perf_counter() - t0 < 1.0
    """))
    (tmp_path / "test_cases.py").write_text(textwrap.dedent("""
        import time
        from _helpers import checks_itself, waited

        def test_clock_in_the_assert():
            t0 = time.monotonic()
            assert time.monotonic() - t0 < 5

        def test_duration_in_a_variable():
            t0 = time.monotonic()
            took = time.monotonic() - t0
            assert took < 5

        def test_a_helper_returns_it(pool):
            assert max(pool.run(waited)[0]) < 5

        def test_a_helper_asserts_it(pool):
            pool.run(checks_itself)

        def test_no_clock():
            assert 1 + 1 == 2
    """))
    found = {node_id.split("::")[1] for node_id in scan(tmp_path)}
    assert found == {"test_clock_in_the_assert", "test_duration_in_a_variable",
                     "test_a_helper_returns_it", "test_a_helper_asserts_it"}
