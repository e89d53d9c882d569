"""Every PYCOMM_* variable the code reads is documented once, with the default it has.

Three places name them: the code that reads them (C++ and Python), the table of
docs/environment.md and ``pycomm.env``'s report (KNOWN_VARIABLES). They drifted once
(the report said PYCOMM_DIRECT_BYTES defaults to 16384; it is 4096, and two variables
the build reads were in no table), so this checks that all three name the same set, that
the report's default starts as the table's does, and that the table's numeric defaults
are the core's own (``_C._config_defaults``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pycomm import env

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"PYCOMM_[A-Z0-9_]+")
# Names that are not settings: the CUDA build's preprocessor macro.
NOT_SETTINGS = {"PYCOMM_CUDA"}


def _read_by_code() -> set[str]:
    files = [*(ROOT / "csrc").rglob("*.[ch]*"), *(ROOT / "pycomm").glob("*.py"),
             ROOT / "setup.py"]
    found: set[str] = set()
    for path in files:
        text = path.read_text()
        found |= {m.group(1) for m in re.finditer(r'"(PYCOMM_[A-Z0-9_]+)"', text)}
    return found - NOT_SETTINGS


def _documented() -> dict[str, str]:
    """The table's rows: name -> default cell (backticks dropped)."""
    rows = {}
    for line in (ROOT / "docs" / "environment.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and NAME.fullmatch(cells[0].strip("`")):
            rows[cells[0].strip("`")] = cells[1].replace("`", "")
    return rows


def _leading(default: str) -> str:
    return re.split(r"[ ,(]", default.strip(), maxsplit=1)[0]


def test_the_code_the_table_and_the_report_name_the_same_variables():
    read, documented, reported = _read_by_code(), set(_documented()), set(env.KNOWN_VARIABLES)
    assert read - documented == set(), "read by the code, not in docs/environment.md"
    assert documented - read == set(), "in docs/environment.md, read by no code"
    assert reported == documented, (reported ^ documented)


def test_the_report_gives_the_tables_default():
    documented = _documented()
    wrong = {name: (env.KNOWN_VARIABLES[name], documented[name]) for name in documented
             if _leading(env.KNOWN_VARIABLES[name]) != _leading(documented[name])}
    assert wrong == {}, wrong


@pytest.mark.usefixtures("require_pycomm")
def test_the_tables_numbers_are_the_cores_defaults():
    from pycomm import _C  # type: ignore[attr-defined]

    documented = _documented()
    core = _C._config_defaults()
    assert core, "the core reported no defaults"
    wrong = {name: (value, documented.get(name)) for name, value in core.items()
             if _leading(documented.get(name, "")) != str(value)}
    assert wrong == {}, wrong
