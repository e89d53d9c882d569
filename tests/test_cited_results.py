"""Every raw result the documentation and the code cite is in the repository.

A figure quoted in README.md, bench/README.md, records/README.md, docs/*.md or a comment
names the folder or file of the runs it comes from (``records/<what was measured>/...``).
Those files must be tracked: a folder that git ignores is left out of every commit without
a word, and the figure then rests on nothing. The benchmarks' default outputs
(``bench/out/``, their ``--out``) are not results anyone quotes, and placeholders in upper
case (``NAME``) are skipped.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITING = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "records" / "README.md",
          *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.py")),
          *sorted((ROOT / "records" / "investigations").glob("*.py")),
          *sorted((ROOT / "csrc").rglob("*.cc")), *sorted((ROOT / "csrc").rglob("*.h")),
          *sorted((ROOT / "pycomm").glob("*.py"))]
# records/<what was measured>/<anything>
CITED = re.compile(
    r"(?<![\w/])records/((?:[A-Za-z0-9_.*@-]|\{[^}/\s]*\})+/(?:[A-Za-z0-9_./*@-]|\{[^}/\s]*\})*)")


@functools.cache
def _tracked() -> list[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "records"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout (an unpacked sdist): nothing to compare against
    return out.splitlines()


def expand_braces(path: str) -> list[str]:
    """``a-{2,4}r.{json,log}`` -> its four paths, as the shell expands them."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[:match.start()], path[match.end():]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def cited_paths(text: str) -> set[str]:
    """The ``records/...`` paths a text cites, as repository paths (no trailing
    punctuation; a folder keeps its slash; braces expanded)."""
    found = set()
    for tail in CITED.findall(text):
        tail = tail.rstrip(".,;:")
        if re.search(r"\b[A-Z]{2,}\b", tail):  # a placeholder: NAME, SIZE
            continue
        found.update("records/" + p for p in expand_braces(tail))
    return found


def exists_in(path: str, tracked: list[str]) -> bool:
    """Whether ``path`` names at least one tracked file: a file, a folder (with or without
    its slash), or the prefix a command's ``--out`` gives its files; any may hold ``*``."""
    return any(fnmatch.fnmatch(t, path + "*") for t in tracked)


def test_the_pattern_reads_citations_as_written():
    text = ("(`records/collectives/two-shot/rs-ag/`), `records/collectives/states/cma-amd/`; "
            "`records/collectives/states/limit-states-amd*.json`. --out bench/out/x.json "
            "records/collectives/NAME.json, `records/c/c-{2,4}r.{json,log}` (x "
            "[a link](../records/moe/fp32.md), records/README.md")
    assert cited_paths(text) == {"records/collectives/two-shot/rs-ag/",
                                 "records/collectives/states/cma-amd/",
                                 "records/collectives/states/limit-states-amd*.json",
                                 "records/c/c-2r.json", "records/c/c-2r.log",
                                 "records/c/c-4r.json", "records/c/c-4r.log"}
    tracked = ["records/collectives/two-shot/rs-ag/summary.md", "records/collectives/a.json"]
    assert exists_in("records/collectives/two-shot/", tracked)
    assert exists_in("records/collectives/two-shot/rs-ag", tracked)
    assert exists_in("records/collectives/*.json", tracked)
    assert exists_in("records/collectives/a", tracked)  # an --out prefix
    assert not exists_in("records/collectives/states/cma-amd/", tracked)
    assert not exists_in("records/collectives/b.json", tracked)


def test_every_cited_result_is_tracked():
    tracked = _tracked()
    if tracked is None:
        pytest.skip("no git checkout: an unpacked sdist holds no results to compare against")
    missing = {}
    for page in CITING:
        for path in cited_paths(page.read_text(encoding="utf-8")):
            if not exists_in(path, tracked):
                missing.setdefault(path, []).append(str(page.relative_to(ROOT)))
    assert not missing, ("cited but not in the repository (ignored, or never committed): "
                         f"{missing}")


@pytest.mark.parametrize(("path", "ignored"), [
    ("bench/out/collectives.json", True),  # the README's first command writes these
    ("bench/out/collectives.png", True),
    ("records/collectives/some-run.json", False),  # a quoted run's files are committed
    ("records/collectives/some-run.job1@pinned.png", False),
])
def test_default_outputs_are_ignored_and_quoted_runs_are_not(path, ignored):
    if _tracked() is None:
        pytest.skip("no git checkout: an unpacked sdist has no .gitignore to apply")
    got = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode
    assert (got == 0) == ignored, f"{path}: git check-ignore says ignored={got == 0}"
