"""pycomm: collective communication for PyTorch over shared memory.

``import pycomm`` registers the torch.distributed backend ``"pycomm"``::

    import pycomm
    import torch.distributed as dist
    dist.init_process_group("pycomm")    # instead of "gloo"

It raises ImportError, saying why and how to fix it, when the compiled extension
``pycomm._C`` cannot be loaded (not built, or built against another torch).
"""

from importlib import metadata as _metadata

from pycomm._backend import BACKEND_NAME, check_extension, extension_error, register
from pycomm.arena import arena_stats, empty, in_arena, use_arena, zeros
from pycomm.bucketer import Bucketer, plan_buckets
from pycomm.flat_arena import Arena
from pycomm.ops import all_reduce_

check_extension()  # none of the imports above loads the extension; this does

try:  # the one version source is pyproject.toml's, read back from the installed metadata
    __version__: str = _metadata.version("pycomm")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = [
    "BACKEND_NAME",
    "Arena",
    "Bucketer",
    "__version__",
    "all_reduce_",
    "arena_stats",
    "empty",
    "extension_error",
    "in_arena",
    "plan_buckets",
    "register",
    "use_arena",
    "zeros",
]

register()
