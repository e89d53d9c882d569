"""Functions for meshes: ``@pw.function(out=...)`` makes ``f(mesh, *args)`` a call.

What the controller knows of a function before it runs is what it was declared with: its
outputs' :class:`~pycomm.parallel.pathways.protocol.Spec` (shapes known in advance let the
receivers of those outputs post their receives at once).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._optional import available, install_command, require

if TYPE_CHECKING:
    from .client import Mesh


class Function:
    """A function to run SPMD on a mesh: ``f(mesh, *args)`` returns its futures.

    ``out`` declares the outputs: None (one output of any kind), a :class:`Spec` (one
    tensor shard of that shape and dtype), or a tuple of those (several outputs).
    """

    def __init__(self, fn: Callable[..., Any], out: Any = None):
        self.fn, self.out = fn, out
        self.__name__ = getattr(fn, "__name__", "function")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", "__main__")
        self.__doc__ = fn.__doc__

    def __call__(self, mesh: Mesh, *args: Any, **kwargs: Any) -> Any:
        return mesh.client.call(self, mesh, *args, out=self.out, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # By reference, as a plain function pickles: the workers import it (the module's
        # attribute is this wrapper, so pickling self.fn by name would not find it).
        return (_imported, (self.__module__, self.__qualname__))


def _imported(module: str, qualname: str) -> Any:
    import importlib

    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


class ByValue:
    """A function the workers cannot import (a script's ``__main__``, a lambda, a local
    function), sent whole by cloudpickle as Ray and Dask send theirs."""

    def __init__(self, fn: Callable[..., Any], cloudpickle: Any):
        self.data = cloudpickle.dumps(fn)
        self.__qualname__ = getattr(fn, "__qualname__", "function")

    def load(self) -> Callable[..., Any]:
        fn = _loaded.get(self.data)
        if fn is None:
            fn = _loaded[self.data] = pickle.loads(self.data)
        return fn


_loaded: dict[bytes, Callable[..., Any]] = {}  # a worker's functions sent by value


def sendable(fn: Any) -> Any:
    """``fn`` as a node carries it: by reference when the workers can import it (it
    pickles by name and is not a script's ``__main__``), else by value (cloudpickle).

    Raises:
        TypeError: it can be sent neither way (cloudpickle missing, or it fails).
    """
    if getattr(fn, "__module__", None) != "__main__":
        try:
            pickle.dumps(fn)
            return fn
        except (pickle.PicklingError, AttributeError, TypeError):
            pass
    if not available("cloudpickle"):
        raise TypeError(f"call: {fn!r} cannot be sent to the workers by reference (they "
                        "import functions by module and name, and cannot import a "
                        "script's __main__, a lambda or a local function): define it in "
                        f"a module, or {install_command('cloudpickle')} to send it by "
                        "value")
    try:
        return ByValue(fn, require("cloudpickle", "pycomm.parallel.pathways (functions by value)"))
    except Exception as e:
        raise TypeError(f"call: {fn!r} cannot be sent to the workers: {e}") from None


def unwrapped(fn: Any) -> Callable[..., Any]:
    """What a worker calls: the function a node carries, unwrapped."""
    if isinstance(fn, ByValue):
        return fn.load()
    return fn.fn if isinstance(fn, Function) else fn


def function(fn: Callable[..., Any] | None = None, *, out: Any = None) -> Any:
    """Decorator: ``@pw.function(out=pw.spec((8,)))`` makes ``fn(ctx, ...)`` callable on a
    mesh from the controller. The function runs on every rank of the mesh with a
    :class:`~pycomm.parallel.pathways.mesh_context.MeshContext` first; it must be importable by
    the workers (a module-level function, pickled by reference)."""
    if fn is None:
        return lambda f: Function(f, out)
    return Function(fn, out)
