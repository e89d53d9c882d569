"""Conformance with torch's contract: every torch.distributed function a CPU backend
serves, run on the candidate backend and on gloo side by side in the same job.

In each rank the default group is the candidate (pycomm) and a gloo group over the
same ranks is the reference; every case (``_conformance_scenarios.CASES``) runs on
both with identical inputs, at world sizes 2, 3 and 4 (one RankPool per world size,
one ``pool.run`` per case), and the parent compares the two results rank by rank:
exactly, unless the case states a tolerance and why. A mismatch fails with the case,
world size, rank, where in the result, and both values; a side that raises or hangs
fails with that side's error (a hung side is ended after a few seconds, printing
every thread's stack, so the suite fails instead of hanging).

Run from the repository root::

    python -m pytest -q tests/test_conformance.py
    PYCOMM_CONFORMANCE_REPORT=conformance.md python -m pytest -q tests/test_conformance.py
    PYCOMM_TEST_BACKEND=gloo python -m pytest -q tests/test_conformance.py  # gloo vs gloo

The last line validates the suite itself: gloo is then the candidate too. With
``PYCOMM_CONFORMANCE_REPORT`` set, a Markdown table (case x world size -> match,
mismatch, error, n/a) with a footnote per failure is written there.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

import _conformance_scenarios as S
import pytest
import torch

from pycomm.testing import RankFailure, RankPool

WORLD_SIZES = (2, 3, 4)
SETUP_TIMEOUT_S = 120.0  # spawning the ranks and the reference group, on a busy machine
MAX_SHOWN = 160  # characters of a value shown in a failure message


@dataclass
class Verdict:
    status: str  # "match", "n/a", "MISMATCH", "ERROR", "skipped"
    detail: str = ""  # one line, for the report's footnote
    message: str = ""  # the whole story, for the failing test
    max_err: float = 0.0  # largest |difference| accepted within a tolerance
    tolerant: bool = False  # the comparison used a tolerance
    notes: list[str] = field(default_factory=list)  # info: differences

    @property
    def failed(self) -> bool:
        return self.status in ("MISMATCH", "ERROR")


REPORT: dict[tuple[str, int], Verdict] = {}


# --- comparison --------------------------------------------------------------------------


def _is_na(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"n/a"}


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        body = value.tolist() if value.numel() <= 12 else f"[{value.numel()} elements]"
        text = f"{body} ({str(value.dtype).replace('torch.', '')}{tuple(value.shape)})"
    else:
        text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


class Comparison:
    """Walks a reference result and a candidate result together, collecting differences.

    Differences under an ``info:`` key become notes; a reference subtree that is
    ``{"n/a": why}`` is not compared.
    """

    def __init__(self, left: str, right: str, tol: dict[str, float] | None):
        self.left, self.right, self.tol = left, right, tol
        self.diffs: list[str] = []
        self.notes: list[str] = []
        self.max_err = 0.0

    def walk(self, ref: Any, cand: Any, path: tuple[str, ...]) -> None:
        if _is_na(ref):
            return
        if isinstance(ref, torch.Tensor) or isinstance(cand, torch.Tensor):
            self._tensors(ref, cand, path)
        elif isinstance(ref, dict) and isinstance(cand, dict):
            for info in (False, True):  # info: keys on one side only are notes
                left = [k for k in ref if str(k).startswith("info:") == info]
                right = [k for k in cand if str(k).startswith("info:") == info]
                if left != right:
                    self._differ((*path, "info:keys") if info else path,
                                 f"keys {left}", f"keys {right}")
            for key in ref:
                if key in cand:
                    self.walk(ref[key], cand[key], (*path, str(key)))
        elif (isinstance(ref, (list, tuple)) and isinstance(cand, (list, tuple))
              and type(ref) is type(cand)):
            if len(ref) != len(cand):
                self._differ(path, _show(ref), _show(cand), f"length {len(ref)} vs {len(cand)}")
            for i, (a, b) in enumerate(zip(ref, cand, strict=False)):
                self.walk(a, b, (*path, f"[{i}]"))
        elif type(ref) is float and type(cand) is float and self.tol and (
                math.isclose(ref, cand, rel_tol=self.tol["rtol"], abs_tol=self.tol["atol"])):
            self.max_err = max(self.max_err, abs(ref - cand))
        elif type(ref) is not type(cand) or ref != cand:
            self._differ(path, _show(ref), _show(cand))

    def _tensors(self, ref: Any, cand: Any, path: tuple[str, ...]) -> None:
        if not (isinstance(ref, torch.Tensor) and isinstance(cand, torch.Tensor)):
            self._differ(path, _show(ref), _show(cand))
            return
        if ref.dtype != cand.dtype or ref.shape != cand.shape:
            self._differ(path, _show(ref), _show(cand), "dtype or shape differs")
            return
        if ref.numel() == 0 or torch.equal(ref, cand):
            return
        inexact = ref.dtype.is_floating_point or ref.dtype.is_complex
        if self.tol and inexact and torch.allclose(cand, ref, **self.tol):
            err = (cand.to(torch.complex128 if ref.dtype.is_complex else torch.float64)
                   - ref.to(torch.complex128 if ref.dtype.is_complex else torch.float64))
            self.max_err = max(self.max_err, float(err.abs().max()))
            return
        a, b = ref.reshape(-1), cand.reshape(-1)
        bad = (a != b).nonzero()
        i = int(bad[0])
        where = f"{int(bad.numel())} of {a.numel()} elements differ; first at flat index {i}: "
        self._differ(path, f"{a[i].item()!r}", f"{b[i].item()!r}",
                     where + f"(whole: {self.left} {_show(ref)} | {self.right} {_show(cand)})")

    def _differ(self, path: tuple[str, ...], ref: str, cand: str, extra: str = "") -> None:
        line = f"{' / '.join(path)}: {self.left} {ref} | {self.right} {cand}"
        if extra:
            line += f"  [{extra}]"
        (self.notes if any(p.startswith("info:") for p in path) else self.diffs).append(line)


def judge(name: str, n: int, results: list[dict[str, Any]], backend: str) -> Verdict:
    """Compare each rank's candidate result with its reference result (and replicas)."""
    case = S.CASES[name]
    refs = [res[S.REFERENCE_ROLE] for res in results]
    cands = [res[S.CANDIDATE_ROLE] for res in results]
    head = f"{name} @ world {n}"
    if all(_is_na(c) for c in cands):
        return Verdict("n/a", cands[0]["n/a"])
    tol = None if (case.exact_world2 and n == 2) else case.tol
    cmp = Comparison("gloo", backend, tol)
    for rank, (ref, cand) in enumerate(zip(refs, cands, strict=True)):
        cmp.walk(ref, cand, (f"rank {rank}",))
    if case.replicated:  # each side's result is the same on every rank, bit for bit
        key = case.replicated if isinstance(case.replicated, str) else None
        for role, values, label in (("candidate", cands, backend), ("reference", refs, "gloo")):
            rep = Comparison(f"{label} rank 0", f"{label} rank r", None)
            for rank in range(1, n):
                a, b = values[0], values[rank]
                if key is not None and isinstance(a, dict) and isinstance(b, dict):
                    a, b = a.get(key), b.get(key)
                rep.walk(a, b, (f"rank {rank} vs rank 0 ({role})",))
            cmp.diffs += rep.diffs
    # the same info: difference on every rank is one note
    notes = list(dict.fromkeys(re.sub(r"^rank \d+ / ", "", note) for note in cmp.notes))
    verdict = Verdict("match", max_err=cmp.max_err, tolerant=tol is not None, notes=notes)
    if cmp.diffs:
        why = f"; tolerance {tol} ({case.tol_why})" if tol else " (exact comparison)"
        verdict.status = "MISMATCH"
        verdict.detail = f"{cmp.diffs[0]}" + (f" (+{len(cmp.diffs) - 1} more)"
                                               if len(cmp.diffs) > 1 else "")
        verdict.message = (f"{head}: {backend} departs from gloo{why}:\n  "
                           + "\n  ".join(cmp.diffs[:20]))
    return verdict


# --- running -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def pool(request, backend):
    with RankPool(request.param, backend=backend, pg_timeout_s=S.PG_TIMEOUT_S) as p:
        yield p


def _case_id(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+]+", "-", name).strip("-")


def run_case(pool: RankPool, name: str, backend: str) -> Verdict:
    """Run one case on every rank and judge it; a failed pool is restarted by the next run."""
    case = S.CASES[name]
    head = f"{name} @ world {pool.world_size}"
    try:
        pool.run(S.setup, name, timeout_s=SETUP_TIMEOUT_S)
    except RankFailure as exc:
        return Verdict("ERROR", f"setup: {S.describe_error(str(exc))}", f"{head}: setup: {exc}")
    try:
        # run_case ends a hung side itself (faulthandler); this is the backstop
        results = pool.run(S.run_case, name, timeout_s=3 * case.timeout_s)
    except RankFailure as exc:
        return Verdict("ERROR", S.describe_error(str(exc)), f"{head}: {exc}")
    verdict = judge(name, pool.world_size, results, backend)
    if verdict.failed:
        # The candidate may be left in a state that would taint the next cases.
        with contextlib.suppress(RankFailure):
            pool.close()
    return verdict


def case_names(backend: str) -> list[str]:
    """The cases that mean something with ``backend`` as the candidate. With gloo as the
    candidate (the suite's self-check) a case gloo itself cannot run (its
    ``gloo_candidate_skip``) compares nothing: it is not generated at all, rather than
    skipped for a reason that names no missing resource (tests/_skip_policy.py), and the
    report shows it as n/a with that reason."""
    return [name for name, case in S.CASES.items()
            if not (backend == "gloo" and case.gloo_candidate_skip)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.name != "test_conformance":
        return
    backend = metafunc.config.getoption("--backend")
    names = case_names(backend)
    for name in S.CASES.keys() - set(names):
        for n in WORLD_SIZES:
            REPORT[(name, n)] = Verdict(
                "n/a", f"gloo as the candidate: {S.CASES[name].gloo_candidate_skip}")
    metafunc.parametrize("name", names, ids=[_case_id(n) for n in names])


def test_conformance(pool, backend, name):
    verdict = run_case(pool, name, backend)
    REPORT[(name, pool.world_size)] = verdict
    assert not verdict.failed, verdict.message


# --- the report --------------------------------------------------------------------------


def _cell(verdict: Verdict | None, footnotes: list[str]) -> str:
    if verdict is None:
        return "not run"

    def note(text: str) -> str:
        if text not in footnotes:  # the same story at several world sizes: one footnote
            footnotes.append(text)
        return f"[{footnotes.index(text) + 1}]"

    if verdict.status == "match":
        cell = "match"
        if verdict.tolerant:
            cell += " (exact)" if verdict.max_err == 0 else f" (max diff {verdict.max_err:.1e})"
        if verdict.notes:
            cell += " " + note("note: " + "; ".join(verdict.notes[:3]))
        return cell
    if verdict.status in ("n/a", "skipped"):
        return f"{verdict.status} {note(verdict.detail)}"
    return f"**{verdict.status}** {note(verdict.detail)}"


def _git_head() -> str:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(__file__))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()[:100] or "unknown"


def write_report(path: str, backend: str) -> None:
    footnotes: list[str] = []
    lines = [
        f"# Conformance: {backend} against gloo (torch {torch.__version__})",
        "",
        f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} at commit "
        f"`{_git_head()}` by tests/test_conformance.py. Each case ran on the candidate's "
        "default group and on a gloo group over the same ranks, with identical integer-valued "
        "inputs; results are compared exactly unless a tolerance is shown.",
        "",
        "| case | torch function | " + " | ".join(f"world {n}" for n in WORLD_SIZES) + " |",
        "|---|---|" + "---|" * len(WORLD_SIZES),
    ]
    counts: dict[str, int] = {}
    for name, case in S.CASES.items():
        cells = []
        for n in WORLD_SIZES:
            verdict = REPORT.get((name, n))
            counts[verdict.status if verdict else "not run"] = counts.get(
                verdict.status if verdict else "not run", 0) + 1
            cells.append(_cell(verdict, footnotes))
        label = name.replace("|", "\\|")
        lines.append(f"| {label} | `{case.function}` | " + " | ".join(cells) + " |")
    lines += ["", "Totals: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), ""]
    tolerances = [f"- {name}: {case.tol} ({case.tol_why})"
                  for name, case in S.CASES.items() if case.tol]
    if tolerances:
        lines += ["Tolerances:", "", *tolerances, ""]
    if footnotes:
        lines += ["Notes:", ""]
        lines += [f"{i}. {text.replace(chr(10), ' ')}" for i, text in enumerate(footnotes, 1)]
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module", autouse=True)
def conformance_report(request):
    yield
    path = os.environ.get("PYCOMM_CONFORMANCE_REPORT")
    if path and REPORT:
        write_report(path, request.config.getoption("--backend"))
