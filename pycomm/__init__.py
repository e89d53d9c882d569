"""pycomm: collective communication for PyTorch over shared memory.

``import pycomm`` registers the torch.distributed backend ``"pycomm"``::

    import pycomm
    import torch.distributed as dist
    dist.init_process_group("pycomm")    # instead of "gloo"

It raises ImportError, saying why and how to fix it, when the compiled extension
``pycomm._C`` cannot be loaded (not built, or built against another torch).
"""

from pycomm._backend import BACKEND_NAME, register
from pycomm._extension import check_extension, extension_error
from pycomm._install import version as _version
from pycomm.arena import arena_stats, empty, in_arena, use_arena, zeros
from pycomm.bucketer import Bucketer, plan_buckets
from pycomm.dispatch_ops import combine, dispatch
from pycomm.flat_arena import Arena
from pycomm.ops import all_reduce_

check_extension()  # none of the imports above loads the extension; this does

__version__: str = _version()
__all__ = [
    "BACKEND_NAME",
    "Arena",
    "Bucketer",
    "__version__",
    "all_reduce_",
    "arena_stats",
    "combine",
    "dispatch",
    "empty",
    "extension_error",
    "in_arena",
    "plan_buckets",
    "register",
    "use_arena",
    "zeros",
]

register()
