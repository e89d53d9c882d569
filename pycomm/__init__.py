"""pycomm: collective communication for PyTorch over shared memory.

``import pycomm`` registers the torch.distributed backend ``"pycomm"``::

    import pycomm
    import torch.distributed as dist
    dist.init_process_group("pycomm")    # instead of "gloo"
"""

from pycomm._backend import BACKEND_NAME, extension_error, register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "__version__", "extension_error", "register"]

register()
