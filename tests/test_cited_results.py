"""Every raw result the documentation and the code cite is in the repository.

A figure quoted in README.md, bench/README.md, docs/*.md or a comment names the folder or
file of the runs it comes from (``bench/results/<topic>/...``; bench/README.md also writes
``results/...``, from bench/). Those files must be tracked: a folder that git ignores is
left out of every commit without a word, and the figure then rests on nothing. The
top-level ``bench/results/*`` files are the commands' default outputs (``--out``), not
results anyone quotes, and placeholders in upper case (``NAME``) are skipped.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITING = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
          *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "csrc").rglob("*.cc")),
          *sorted((ROOT / "csrc").rglob("*.h")), *sorted((ROOT / "pycomm").glob("*.py"))]
# bench/results/<topic>/<anything>, or results/<topic>/... as bench/README.md writes it
CITED = re.compile(
    r"(?<![\w/])(?:bench/)?results/((?:[A-Za-z0-9_.*@-]|\{[^}/\s]*\})+/(?:[A-Za-z0-9_./*@-]|\{[^}/\s]*\})*)")


@functools.cache
def _tracked() -> list[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, check=True,
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
    """The ``bench/results/...`` paths a text cites, as repository paths (no trailing
    punctuation; a folder keeps its slash; braces expanded)."""
    found = set()
    for tail in CITED.findall(text):
        tail = tail.rstrip(".,;:")
        if re.search(r"\b[A-Z]{2,}\b", tail):  # a placeholder: NAME, SIZE
            continue
        found.update("bench/results/" + p for p in expand_braces(tail))
    return found


def exists_in(path: str, tracked: list[str]) -> bool:
    """Whether ``path`` names at least one tracked file: a file, a folder (with or without
    its slash), or the prefix a command's ``--out`` gives its files; any may hold ``*``."""
    return any(fnmatch.fnmatch(t, path + "*") for t in tracked)


def test_the_pattern_reads_citations_as_written():
    text = ("(`bench/results/i30/two-shot/rs-ag/`), `results/i30/states/cma-amd/`; "
            "`bench/results/i30/states/limit-states-amd*.json`. --out bench/results/x.json "
            "bench/results/i30/NAME.json, `bench/results/i30/c/c-{2,4}r.{json,log}` (x")
    assert cited_paths(text) == {"bench/results/i30/two-shot/rs-ag/",
                                 "bench/results/i30/states/cma-amd/",
                                 "bench/results/i30/states/limit-states-amd*.json",
                                 "bench/results/i30/c/c-2r.json", "bench/results/i30/c/c-2r.log",
                                 "bench/results/i30/c/c-4r.json", "bench/results/i30/c/c-4r.log"}
    tracked = ["bench/results/i30/two-shot/rs-ag/summary.md", "bench/results/i30/a.json"]
    assert exists_in("bench/results/i30/two-shot/", tracked)
    assert exists_in("bench/results/i30/two-shot/rs-ag", tracked)
    assert exists_in("bench/results/i30/*.json", tracked)
    assert exists_in("bench/results/i30/a", tracked)  # an --out prefix
    assert not exists_in("bench/results/i30/states/cma-amd/", tracked)
    assert not exists_in("bench/results/i30/b.json", tracked)


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
    ("bench/results/collectives.json", True),  # the README's first command writes these
    ("bench/results/collectives.png", True),
    ("bench/results/i30/some-run.json", False),  # a quoted run's files are committed
    ("bench/results/i30/some-run.job1@pinned.png", False),
])
def test_default_outputs_are_ignored_and_quoted_runs_are_not(path, ignored):
    if _tracked() is None:
        pytest.skip("no git checkout: an unpacked sdist has no .gitignore to apply")
    got = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode
    assert (got == 0) == ignored, f"{path}: git check-ignore says ignored={got == 0}"
