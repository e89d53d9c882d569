"""Which tests depend on wall-clock time: an ``assert`` whose expression reads a clock
(``time.monotonic()``, ``perf_counter()``, ``time.time()``, ...) or a value derived from
one, in the same function or returned by a function of the suite that computes it
(a rank function that returns how long it waited, across the ``_*`` helper modules).
A test depends on time if it has such an assert, or calls (or hands a rank pool) a
function of the suite that has one.

``tests/test_timing_registry.py`` holds the suite to ``tests/timing_sensitive.txt``, the
list CI runs beside CPU-bound loops (``.ci/run``): a test that newly depends on time
fails until it is listed, and so runs on a busy machine in every CI run.

    python -m tests._timing_scan            # the node ids the scan finds, one per line
    python -m tests._timing_scan --listed   # those timing_sensitive.txt lists (CI's set)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns",
          "time_ns", "process_time", "thread_time"}
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _reads_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id == "time" and f.attr in CLOCKS
    return isinstance(f, ast.Name) and f.id in {"perf_counter", "monotonic"}


def _refs(node: ast.AST) -> set[str]:
    """The names ``node`` reads, and its ``alias.attribute`` references."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            out.add(f"{n.value.id}.{n.attr}")
    return out


def _bound(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


class Module:
    """One file of the suite: its functions and what its names stand for."""

    def __init__(self, path: Path):
        self.name, self.tree = path.stem, ast.parse(path.read_text())
        self.functions = [n for n in ast.walk(self.tree) if isinstance(n, Function)]
        self.imports: dict[str, str] = {}  # local name -> "module:function" or "module:"
        for node in self.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}:{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{alias.name}:"

    def local_names(self, qualified: set[str]) -> set[str]:
        """How this module refers to the functions ``qualified`` ("module:function")."""
        out = {q.split(":")[1] for q in qualified if q.startswith(f"{self.name}:")}
        for local, target in self.imports.items():
            if target in qualified:
                out.add(local)
            elif target.endswith(":"):
                out |= {f"{local}.{q.split(':')[1]}" for q in qualified
                        if q.startswith(target)}
        return out


def _tainted_names(fn: Function, seeds: set[str]) -> set[str]:
    """Names in ``fn`` bound to clock readings or to values derived from them."""
    tainted = set(seeds)

    def derived(node: ast.AST) -> bool:
        return any(_reads_clock(n) for n in ast.walk(node)) or bool(_refs(node) & tainted)

    for _ in range(3):  # until assignments later in the body have fed earlier ones
        for node in ast.walk(fn):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and value is not None:
                if derived(value):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        tainted |= _bound(t)
            elif isinstance(node, ast.For | ast.comprehension) and derived(node.iter):
                tainted |= _bound(node.target)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) \
                    and any(derived(a) for a in node.args):  # waited.append(elapsed)
                tainted.add(node.func.value.id)
    return tainted


def _derived(node: ast.AST, tainted: set[str]) -> bool:
    return any(_reads_clock(n) for n in ast.walk(node)) or bool(_refs(node) & tainted)


def scan(directory: Path = TESTS) -> list[str]:
    """The node ids (``tests/test_x.py::test_name``) of the tests that depend on time."""
    modules = [Module(p) for p in sorted(directory.glob("*.py"))]
    returns_time: set[str] = set()  # "module:function" returning a clock-derived value
    asserts_time: set[str] = set()  # "module:function" asserting on one (or calling one)
    for _ in range(6):  # to a fixed point across the modules
        before = (len(returns_time), len(asserts_time))
        for m in modules:
            seeds = m.local_names(returns_time)
            callees = m.local_names(asserts_time)
            for fn in m.functions:
                tainted = _tainted_names(fn, seeds)
                key = f"{m.name}:{fn.name}"
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assert) and _derived(node.test, tainted):
                        asserts_time.add(key)
                    if isinstance(node, ast.Return) and node.value is not None \
                            and _derived(node.value, tainted):
                        returns_time.add(key)
                if _refs(fn) & callees - {fn.name}:
                    asserts_time.add(key)
        if (len(returns_time), len(asserts_time)) == before:
            break
    return sorted(f"tests/{m}.py::{f}" for m, _, f in (k.partition(":") for k in asserts_time)
                  if m.startswith("test_") and f.startswith("test_"))


def listed(path: Path = TESTS / "timing_sensitive.txt") -> list[str]:
    """The node ids ``timing_sensitive.txt`` lists (each line's first word)."""
    lines = (line.split("#")[0].split() for line in path.read_text().splitlines())
    return sorted(words[0] for words in lines if words)


if __name__ == "__main__":
    ids = listed() if sys.argv[1:] == ["--listed"] else scan()
    print("\n".join(ids))
