"""Optional dependencies: which extra of pycomm brings each, and the errors that say so.

Every import of a module outside pycomm's requirements (torch) in pycomm/,
parallel/ and bench/ goes through here, so that a missing one names what needs it and
the exact command that installs it, not a bare ``No module named 'zmq'``::

    zmq = require("zmq", "pycomm.parallel.ps (the parameter server's transport)")

or, where the module's types are used at module level::

    try:
        import zmq
    except ModuleNotFoundError as err:
        raise missing("zmq", "pycomm.parallel.ps (...)", err) from err

``available()`` is for the few that only add something (a plot, a progress bar): None
without them, and ``note()`` says what was left out and how to get it. (It lives in
parallel/, whose package imports nothing, so that using it does not import pycomm and
its extension; pycomm/ itself imports no optional dependency.)
"""

from __future__ import annotations

import importlib
from types import ModuleType

# pip's name for this project (pyproject.toml's; pycomm._install.DISTRIBUTION too, kept
# here so that this module imports nothing of pycomm): "pycomm" on PyPI is another's.
DISTRIBUTION = "pycomm-collectives"

# import name -> (pip name, the extra of pycomm that installs it; pyproject.toml's
# [project.optional-dependencies] lists the pip name under that extra).
EXTRAS: dict[str, tuple[str, str]] = {
    "zmq": ("pyzmq", "ps"),
    "numpy": ("numpy", "ps"),
    "transformers": ("transformers", "hf"),
    "safetensors": ("safetensors", "hf"),
    "matplotlib": ("matplotlib", "bench"),
    "tqdm": ("tqdm", "bench"),
    "mpi4py": ("mpi4py", "mpi"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "cupy": ("cupy-cuda12x", "cupy"),
    "ray": ("ray", "ray"),
    "cloudpickle": ("cloudpickle", "pathways"),
    "datasets": ("datasets", "data"),
    "tensorboard": ("tensorboard", "tensorboard"),
}


def install_command(module: str) -> str:
    """``pip install 'pycomm-collectives[EXTRA]', or pip install NAME`` for ``module``."""
    pip_name, extra = EXTRAS[module.partition(".")[0]]
    return f"pip install '{DISTRIBUTION}[{extra}]', or pip install {pip_name}"


def missing(module: str, purpose: str, err: ImportError | None = None) -> ModuleNotFoundError:
    """The error to raise (``from err``) when ``module`` cannot be imported for ``purpose``."""
    top = module.partition(".")[0]
    pip_name = EXTRAS[top][0]
    why = ("is not installed" if err is None or err.name in (None, top) or
           top.startswith(f"{err.name}.") else f"cannot be imported ({err})")
    return ModuleNotFoundError(f"{purpose} needs {pip_name}, which {why}: "
                               f"{install_command(top)}", name=module)


def require(module: str, purpose: str) -> ModuleType:
    """``module``, imported; ModuleNotFoundError naming ``purpose`` and the extra without it."""
    try:
        importlib.import_module(module.partition(".")[0])  # the package itself first
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise missing(module, purpose, err) from err


def available(module: str) -> ModuleType | None:
    """``module``, imported, or None when it cannot be (for what only adds something)."""
    EXTRAS[module.partition(".")[0]]  # KeyError: a dependency this table does not name
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def note(module: str, left_out: str) -> str:
    """"no plot: matplotlib is not installed (pip install 'pycomm-collectives[bench]', or ...)"."""
    pip_name = EXTRAS[module.partition(".")[0]][0]
    return f"no {left_out}: {pip_name} is not installed ({install_command(module)})"
