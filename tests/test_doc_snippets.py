"""Every code block of README.md and docs/*.md is held to the code it shows (issue 60:
docs that failed as written, and today's moves would have broken a few more).

- A ``python`` block compiles, every name it imports from this project resolves, and
  every ``alias.attribute`` it reads from a module it imported exists there.
- A ``bash`` block's ``python -m MODULE`` and ``torchrun ... -m MODULE`` name modules
  this checkout has, and its ``pip install ".[EXTRAS]"`` names extras pyproject.toml
  defines.

The blocks are not run here (most start ranks, a cluster or a benchmark of minutes);
the README's two commands run in CI as written, and tests/test_examples.py runs the
examples the docs start.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli to Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?ms)^```(\w+)\n(.*?)^```")
OURS = ("pycomm", "bench")
MODULE_RUN = re.compile(r"(?:\bpython3?|\btorchrun\b[^\n]*?)\s+-m\s+([\w.]+)")
EXTRAS = re.compile(r"""pip install[^\n]*?['"]?\.\[([\w,-]+)\]""")


def _blocks(lang: str) -> list[Any]:
    """(page, block number, code) of every ``lang`` block, named page-number."""
    out = []
    for page in PAGES:
        blocks = [b for b in BLOCK.findall(page.read_text()) if b[0] == lang]
        out += [pytest.param(page.name, i, code, id=f"{page.name}-{i}")
                for i, (_, code) in enumerate(blocks)]
    return out


def _resolve(module: str, name: str) -> Any:
    """``name`` from ``module``: an attribute, or else a submodule."""
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")


def _imported(tree: ast.Module) -> dict[str, Any]:
    """Local name -> object, for every import of this project's names in ``tree``."""
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OURS:
            for alias in node.names:
                names[alias.asname or alias.name] = _resolve(node.module or "", alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    module = importlib.import_module(alias.name)
                    names[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else importlib.import_module(
                            alias.name.split(".")[0]))
    return names


def _missing_attributes(tree: ast.Module, names: dict[str, Any]) -> list[str]:
    """``alias.attr`` reads, off an imported module, of attributes it does not have."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and isinstance(names.get(node.value.id), ModuleType)
                and not hasattr(names[node.value.id], node.attr)):
            out.append(f"{node.value.id}.{node.attr}")
    return out


@pytest.mark.parametrize(("page", "index", "code"), _blocks("python"))
def test_a_python_block_compiles_and_its_names_exist(page, index, code):
    tree = ast.parse(code, filename=f"{page} python block {index}")
    names = _imported(tree)
    assert not _missing_attributes(tree, names), (page, index, _missing_attributes(tree, names))


def _extras() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


@pytest.mark.parametrize(("page", "index", "code"), _blocks("bash"))
def test_a_bash_blocks_modules_and_extras_exist(page, index, code):
    for module in MODULE_RUN.findall(code):
        if module.split(".")[0] in (*OURS, "records"):
            assert importlib.util.find_spec(module) is not None, (page, index, module)
    extras = _extras()
    for listed in EXTRAS.findall(code):
        unknown = set(listed.split(",")) - extras
        assert not unknown, (page, index, f"extras {sorted(unknown)} are not in pyproject.toml")


def test_the_checker_sees_drift():
    """The checks themselves: a moved module, a missing name, an unknown extra."""
    with pytest.raises(ImportError):
        _imported(ast.parse("from pycomm.parallel.compose.apply_tp import styles_by_path"))
    with pytest.raises(ImportError):  # neither a name of the package nor a module of it
        _imported(ast.parse("from pycomm.parallel.tensor import no_such_name"))
    tree = ast.parse("import pycomm\npycomm.no_such_function()")
    assert _missing_attributes(tree, _imported(tree)) == ["pycomm.no_such_function"]
    assert EXTRAS.findall('pip install -e ".[hf,nope]"') == ["hf,nope"]
    assert "nope" not in _extras()
    assert len(_blocks("python")) >= 15 and len(_blocks("bash")) >= 10
