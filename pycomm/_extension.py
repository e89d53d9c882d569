"""The compiled extension ``pycomm._C``: loading it, and what to say when it does not load.

``import pycomm`` loads it and raises ImportError (as ``import torch`` does without its
own ``_C``) when it cannot be loaded: not built, or built against another torch. The
message says why, which torch is running and which one the build was made for (when its
installed metadata says), and how to fix it, for a source checkout and for an installed
copy alike. ``PYCOMM_ALLOW_NO_EXTENSION=1`` imports pycomm without it (``python -m
pycomm.env``'s report, the tests on gloo): creating a pycomm group then raises that
message. Every module that needs the extension imports :func:`load` from here, which
depends on nothing of pycomm but ``_install``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from pycomm import _install

# Set to 1: ``import pycomm`` succeeds without a loadable extension (see the docstring).
ALLOW_NO_EXTENSION = "PYCOMM_ALLOW_NO_EXTENSION"


def extension_error() -> str | None:
    """Why ``pycomm._C`` cannot be loaded, or None when it can."""
    try:
        load()
    except RuntimeError as exc:
        return str(exc)
    return None


def load_failure(exc: BaseException) -> str:
    """What to tell the user when ``pycomm._C`` does not import: ``exc``, the torch running
    and the one the build was made for, and the fix for this copy of pycomm."""
    running = str(torch.__version__)
    built = _install.built_against()
    lines = [f"pycomm: the C++ extension pycomm._C cannot be loaded: {exc}",
             f"torch {running} is running; pycomm was built against "
             + (f"torch {built} (its installed metadata's requirement)." if built else
                "a torch that is not recorded (no installed metadata of this copy pins one).")]
    root = _install.checkout_root()
    if root is not None:
        lines += [f"This pycomm is a source checkout ({root}): build the extension against "
                  "the running torch, from the checkout's root:",
                  f"    cd {root} && pip install --no-build-isolation -e ."]
    else:
        lines += [f"This pycomm is an installed copy ({_install.PACKAGE_DIR}): reinstall it "
                  "so that it compiles against the running torch:",
                  "    pip install --no-build-isolation --force-reinstall --no-deps "
                  f"--no-binary {_install.DISTRIBUTION} {_install.DISTRIBUTION}"]
    if built and built != running.partition("+")[0]:
        lines.append(f"or run the torch it was built against: pip install torch=={built}")
    return "\n".join(lines)


def load() -> ModuleType:
    """pycomm._C; RuntimeError saying why and how to fix it when it does not load."""
    try:
        # import_module, not `from pycomm import _C`: during ``import pycomm`` that would
        # say "partially initialized module" instead of what is wrong.
        return importlib.import_module("pycomm._C")
    except ImportError as exc:
        raise RuntimeError(load_failure(exc)) from exc


def check_extension() -> None:
    """What ``import pycomm`` runs: ImportError, chained from the original one, when the
    extension does not load (unless PYCOMM_ALLOW_NO_EXTENSION=1)."""
    if os.environ.get(ALLOW_NO_EXTENSION) == "1":
        return
    try:
        load()
    except RuntimeError as exc:
        raise ImportError(f"{exc}\n({ALLOW_NO_EXTENSION}=1 imports pycomm without it, "
                          "e.g. for python -m pycomm.env's report.)",
                          name="pycomm._C") from exc.__cause__
