"""The packages' modules import one another without a cycle, and pycomm.parallel's
packages stand on floors: each imports only packages below it (``FLOORS``).

A cycle (``pycomm._backend`` -> ``islands`` -> ``_log`` -> ``_backend`` was one) makes a
module's import work or fail by which one is imported first, and hides layering: here
the loader of the extension (``pycomm._extension``) depends on nothing of pycomm but
``_install``, and the registration (``_backend``) on the modules it wires. Imports inside
functions count (they run the same code, later); ``if TYPE_CHECKING:`` ones do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if "examples" in path.parts:  # scripts, not modules of the package
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports at run time. ``from pkg import
    sub`` is an edge to pkg.sub alone when every name it takes is a submodule; a name
    defined by pkg's ``__init__`` makes it an edge to pkg too."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            subs = {f"{base}.{alias.name}" for alias in node.names}
            out |= subs if subs <= modules else {base} | (subs & modules)
    return out & modules - {name}


def _graph(packages: list[str]) -> dict[str, set[str]]:
    modules = {k: v for p in packages for k, v in _modules(p).items()}
    return {name: _imported(ast.parse(path.read_text()), name, path.name == "__init__.py",
                            set(modules))
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (its modules in order), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


@pytest.mark.parametrize("packages", [["pycomm"], ["parallel", "pycomm"], ["bench", "pycomm"]])
def test_no_module_imports_itself_through_others(packages):
    cycle = _cycle(_graph(packages))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_finder_sees_a_cycle():
    """The check itself: a cycle through a function-level import is found, a
    TYPE_CHECKING one is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n"
                     "def f():\n    from x import z\n")
    assert _imported(tree, "m", False, {"x", "x.y", "x.z", "m"}) == {"x.z"}
    tree = ast.parse("from x import z, helper\n")  # helper: a name x's __init__ defines
    assert _imported(tree, "m", False, {"x", "x.z", "m"}) == {"x", "x.z"}


# pycomm.parallel's floors, bottom up. A package imports packages of lower floors only
# (inside functions too; not under TYPE_CHECKING): the strategies stand on the ground
# (the mesh shape, the RNG tracker, a model's blocks, the Plan type), each owning its
# plan-driven side (tensor's styles, recompute's and ZeRO-3's units from a plan), the
# composition on the strategies, the job's description on the composition, the planner on
# the job, the trainer on the planner, the single controller on the trainer. A new
# package is given its floor here.
FLOORS = [
    {"_optional", "rng", "grad_hooks", "precision", "mesh", "blocks", "plans"},
    {"tensor", "recompute", "pipeline", "ps"},
    {"data", "checkpointing", "moe"},
    {"zero"},
    {"models"},
    {"compose"},
    {"job"},
    {"planner"},
    {"train"},
    {"pathways"},
]


def _package_edges() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(importing package, imported package) -> the module pairs behind that arrow."""
    def package(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, imported in _graph(["parallel"]).items():
        for other in imported:
            if package(module) and package(other) and package(module) != package(other):
                edges.setdefault((package(module), package(other)), []).append((module, other))
    return edges


def test_every_package_of_parallel_has_a_floor():
    packages = {p.stem if p.suffix else p.name for p in (ROOT / "parallel").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__")
                or (p.is_dir() and (p / "__init__.py").exists())}
    floored = set().union(*FLOORS)
    assert packages == floored, (f"without a floor: {sorted(packages - floored)}; "
                                 f"gone: {sorted(floored - packages)}")


def _upward(edges: dict[tuple[str, str], list[tuple[str, str]]]
            ) -> dict[tuple[str, str], list[tuple[str, str]]]:
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    return {arrow: pairs for arrow, pairs in edges.items() if floor[arrow[1]] >= floor[arrow[0]]}


def test_packages_import_only_lower_floors():
    upward = _upward(_package_edges())
    assert not upward, "imports that do not go down a floor:\n" + "\n".join(
        f"  {a} -> {b}: {pairs[:3]}" for (a, b), pairs in sorted(upward.items()))


def test_the_floor_check_sees_an_upward_or_sideways_import():
    edges = {("zero", "tensor"): [("z", "t")], ("tensor", "zero"): [("t", "z")],
             ("data", "moe"): [("d", "m")]}
    assert set(_upward(edges)) == {("tensor", "zero"), ("data", "moe")}
