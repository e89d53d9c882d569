"""A missing optional dependency names what needs it and the extra that installs it.

Every import site of a module outside pycomm's requirements (torch) in pycomm/,
parallel/ and bench/ is a row of SITES; each runs in a subprocess in which that module
cannot be imported (``sys.modules[name] = None``, what a missing package looks like to
``import``): a site that needs it must raise ModuleNotFoundError whose message names
the extra (``pip install 'pycomm-collectives[ps]'``) and the pip name; one that only adds something
(a plot, a bar) must do without it. A scan of the sources finds every such site, so a new
optional import without a row here (or not going through parallel/_optional.py) fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from pycomm.parallel import _optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli to Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"torch", "pycomm", "parallel", "bench", "records"}
SCANNED = ("pycomm", "parallel", "bench", "records/investigations")

# pycomm.parallel.ps's modules one by one: a stand-in for the package (its __init__ imports the
# worker, whose own error would come first) lets each module's import site be reached.
_PS = "import types; ps = types.ModuleType('pycomm.parallel.ps'); ps.__path__ = ['parallel/ps']; " \
      "sys.modules['pycomm.parallel.ps'] = ps; "


@dataclass(frozen=True)
class Site:
    file: str  # where the import is
    module: str  # the top-level module it imports
    code: str  # what reaches it (run with the module unimportable)
    soft: str = ""  # for what only adds something: what `code` prints without it

    @property
    def id(self) -> str:
        return f"{self.file}:{self.module}"


SITES = [
    Site("parallel/ps/worker.py", "zmq", "import pycomm.parallel.ps"),  # what a user imports
    Site("parallel/ps/node.py", "zmq", _PS + "import pycomm.parallel.ps.node"),
    Site("parallel/ps/scheduler.py", "zmq", _PS + "import pycomm.parallel.ps.scheduler"),
    Site("parallel/ps/server.py", "zmq", _PS + "import pycomm.parallel.ps.server"),
    Site("parallel/ps/ring.py", "numpy", _PS + "import pycomm.parallel.ps.ring"),
    Site("parallel/ps/filters.py", "numpy", _PS + "import pycomm.parallel.ps.filters"),
    Site("parallel/ps/examples/ctr_data.py", "numpy",
         _PS + "import pycomm.parallel.ps.examples.ctr_data"),
    Site("parallel/compose/export.py", "transformers",
         "from pycomm.parallel.compose.export import save_pretrained; "
         "save_pretrained('c', None, 'o')"),
    Site("parallel/compose/pretrained.py", "safetensors",
         "from pycomm.parallel.compose.pretrained import load_pretrained; "
         "load_pretrained(None, 'x')"),
    Site("parallel/models/hf.py", "transformers",
         "from pycomm.parallel.models.hf import attention_mask; "
         "attention_mask('full_attention', None, None)"),
    Site("parallel/job/models.py", "transformers",
         "from pycomm.parallel.job.models import _transformers; _transformers()"),
    Site("parallel/train/tokenizer.py", "transformers",
         "from pycomm.parallel.train.tokenizer import load_tokenizer; load_tokenizer('t', True)"),
    Site("parallel/train/hf_data.py", "datasets",
         "from pycomm.parallel.train.hf_data import _load; from pathlib import Path; "
         "_load(Path('x.txt'), 'line')"),
    Site("parallel/train/board.py", "tensorboard",
         "from pycomm.parallel.train.board import Board; Board('runs', 0)"),
    Site("parallel/train/logs.py", "tqdm",  # the lines go out plainly, not through a bar
         "import pycomm.parallel.train.logs as m; print(m._tqdm)", soft="None"),
    Site("parallel/planner/shapes.py", "transformers",  # a Llama is then counted by hand
         "from pycomm.parallel.planner.shapes import model_shape; "
         "from pycomm.parallel.job.config import TrainConfig; "
         "print(type(model_shape(TrainConfig(model='llama'))).__name__)", soft="ModelShape"),
    Site("parallel/pipeline/timeline.py", "matplotlib",
         "from pycomm.parallel.pipeline.timeline import plot_timeline; "
         "print(plot_timeline([], 'x.png'))",
         soft="False"),
    Site("parallel/train/plot.py", "matplotlib",
         "from pycomm.parallel.train.plot import loss_curve; from pathlib import Path; "
         "print(loss_curve([], Path('x.png'), 't'))", soft="False"),
    Site("parallel/train/metrics.py", "tqdm",
         "import pycomm.parallel.train.metrics as m; print(m.tqdm)", soft="None"),
    Site("parallel/train/metrics.py", "matplotlib",  # the trainer's line when it drew no plot
         "from pycomm.parallel.train.metrics import Metrics; "
         "Metrics(True, '', 'x.png', False, 1, 0).close('t')",
         soft="no plot: matplotlib is not installed (pip install "
              "'pycomm-collectives[bench]', or pip install matplotlib)"),
    Site("bench/_dcp_runs.py", "transformers",
         "from bench._dcp_runs import exported_logits; exported_logits('llama', 'c', 'o')"),
    Site("bench/_deepspeed.py", "deepspeed",  # bench.collectives skips the peer, saying this
         "from bench._deepspeed import missing; print(missing())",
         soft="deepspeed is not installed (pip install 'pycomm-collectives[deepspeed]', "
              "or pip install deepspeed)"),
    Site("parallel/compose/export.py", "safetensors",
         "from pycomm.parallel.compose.export import save_pretrained; "
         "save_pretrained('c', None, 'o')"),
    Site("bench/host_adam.py", "deepspeed",
         "from bench.host_adam import _deepspeed_step; _deepspeed_step([], None)"),
    Site("bench/offload_recipe.py", "transformers",
         "from bench.offload_recipe import _engine_logits; _engine_logits('x')"),
    Site("bench/_model_zoo.py", "transformers",
         "from bench._model_zoo import TINY, _hf; _hf('llama', TINY)"),
    Site("bench/_mpi.py", "mpi4py", "from bench._mpi import _mpi; _mpi()"),
    Site("bench/_report.py", "matplotlib",
         "from bench._report import write_plot; from pathlib import Path; "
         "print(write_plot(Path('x.png'), [], [], {}, 2))", soft="False"),
    Site("bench/_train_plot.py", "matplotlib",
         "from bench._train_plot import plot; from pathlib import Path; "
         "print(plot('data', {}, Path('x.png')))", soft="False"),
    Site("bench/collectives.py", "tqdm",
         "import torch.distributed as dist; dist.get_rank = lambda *a, **k: 0; "
         "from bench.collectives import _progress; print(_progress(3, False))", soft="None"),
    Site("bench/collectives.py", "matplotlib",  # its note when write_plot drew nothing
         "from pycomm.parallel._optional import note; print(note('matplotlib', 'plot'))  # note",
         soft="no plot: matplotlib is not installed (pip install "
              "'pycomm-collectives[bench]', or pip install matplotlib)"),
    Site("bench/headline.py", "matplotlib",
         "from bench.headline import plot; from pathlib import Path; "
         "print(plot({}, [], Path('x.png')))", soft="False"),
    Site("bench/ps_consistency.py", "matplotlib",
         "from bench.ps_consistency import plot; from pathlib import Path; "
         "print(plot({}, Path('x.png'), 't'))", soft="False"),
    Site("bench/ps_throughput.py", "matplotlib",
         "from bench.ps_throughput import plot; from pathlib import Path; "
         "print(plot([], Path('x.png')))", soft="False"),
    Site("bench/ps_traffic.py", "matplotlib",
         "from bench.ps_traffic import plot; from pathlib import Path; "
         "print(plot([], Path('x.png')))", soft="False"),
    Site("bench/training.py", "matplotlib",  # its note when plot() drew nothing
         "from pycomm.parallel._optional import note; print(note('matplotlib', 'plot'))  # note",
         soft="no plot: matplotlib is not installed (pip install "
              "'pycomm-collectives[bench]', or pip install matplotlib)"),
    Site("parallel/pathways/ray_launch.py", "ray", "import pycomm.parallel.pathways.ray_launch"),
    Site("bench/ray_dispatch.py", "ray", "import bench.ray_dispatch"),
    Site("parallel/pathways/functions.py", "cloudpickle",  # a lambda: only by value
         "import pytest; from pycomm.parallel.pathways.functions import sendable; "
         "e = pytest.raises(TypeError, sendable, lambda c: 1); "
         "print('pycomm-collectives[pathways]' in str(e.value))", soft="True"),
]


def _run_without(module: str, code: str) -> subprocess.CompletedProcess:
    program = textwrap.dedent(f"""
        import sys
        sys.modules[{module!r}] = None  # import {module} now raises ModuleNotFoundError
        {code}
    """)
    return subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.id)
def test_missing_optional_dependency_names_its_extra(site):
    pip_name, extra = _optional.EXTRAS[site.module]
    proc = _run_without(site.module, site.code)
    if site.soft:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == site.soft
        return
    assert proc.returncode != 0, f"ran without {site.module}:\n{proc.stdout}"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: "), proc.stderr[-3000:]
    assert f"pip install 'pycomm-collectives[{extra}]'" in last, last
    assert f"pip install {pip_name}" in last, last
    assert "which is not installed" in last, last
    # Chained from the original error (the traceback shows both).
    assert "The above exception was the direct cause" in proc.stderr


def _is_optional(module: str | None) -> bool:
    top = (module or "").partition(".")[0]
    return bool(top) and top not in sys.stdlib_module_names and top not in REQUIRED


def _helper_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Calls of pycomm.parallel._optional's require/available/missing, with their module."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in {"require", "available", "missing", "note", "install_command"}
                and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            out.append((node, node.args[0].value))
    return out


def _scan() -> tuple[set[tuple[str, str]], list[str]]:
    """(file, module) of every optional import site, and the bare imports of one that do
    not go through parallel/_optional.py."""
    sites: set[tuple[str, str]] = set()
    bare: list[str] = []
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in filter(_is_optional, names):
                top = name.partition(".")[0]
                sites.add((rel, top))
                # Allowed: inside a try whose handler raises missing(...) for it, or in a
                # function that first checked it with require()/available().
                scope: ast.AST | None = node
                guarded = False
                while scope is not None and not guarded:
                    scope = parents.get(scope)
                    if isinstance(scope, ast.Try):
                        guarded = any(m == top or m.startswith(f"{top}.") for h in scope.handlers
                                      for _, m in _helper_calls(h))
                    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        guarded = any(m.partition(".")[0] == top and c.lineno < node.lineno
                                      for c, m in _helper_calls(scope))
                        break
                if not guarded:
                    bare.append(f"{rel}:{node.lineno}: import {name}")
        sites |= {(rel, m.partition(".")[0]) for _, m in _helper_calls(tree)
                  if rel != "parallel/_optional.py"}
    return sites, bare


def test_every_optional_import_site_has_a_row_and_uses_the_helper():
    sites, bare = _scan()
    assert bare == [], "import these through pycomm.parallel._optional (require/available/missing)"
    tabled = {(s.file, s.module) for s in SITES}
    assert sites - tabled == set(), "optional import sites without a row in SITES"
    assert tabled - sites == set(), "rows of SITES whose import site is gone"
    assert {m for _, m in sites} <= set(_optional.EXTRAS)


def test_every_extra_named_lists_the_package():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, (pip_name, extra) in _optional.EXTRAS.items():
        names = {req.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
                 for req in extras.get(extra, [])}
        assert pip_name in names, (f"{module}: pycomm-collectives[{extra}] does not install "
                                   f"{pip_name}")


def test_require_keeps_a_missing_module_inside_the_dependency_apart(monkeypatch):
    """Only the dependency itself missing reads "is not installed"; an import error from
    inside an installed one is quoted."""
    err = ModuleNotFoundError("No module named 'zmq.backend'", name="zmq.backend")
    message = str(_optional.missing("zmq", "pycomm.parallel.ps", err))
    assert "cannot be imported (No module named 'zmq.backend')" in message
    assert "pip install 'pycomm-collectives[ps]'" in message
    with pytest.raises(KeyError):
        _optional.require("not_a_dependency_pycomm_knows", "x")
