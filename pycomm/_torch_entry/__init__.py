"""torch's ``torch.backends`` entry point: ``init_process_group("pycomm")`` without
``import pycomm``.

torch calls :func:`register_lazily` at the end of every ``import torch`` (unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). It only registers the name, with a creator that
imports pycomm the first time a group asks for the backend: ``import torch`` loads no
extension, and a pycomm that cannot load fails the ``init_process_group`` that wants it
(with ``import pycomm``'s message saying how to rebuild it), never ``import torch`` —
which an exception raised here would (torch turns it into "Failed to load the backend
extension"). That is also why this is its own top-level package, ``pycomm_autoload``
(setup.py maps this folder to it): torch imports the entry point's module, and inside
``pycomm`` that would import ``pycomm`` and its extension first. (The folder is not named
``_autoload``: setuptools' editable install reads ``pycomm_autoload`` in
``pycomm/_autoload`` as ``pycomm`` + ``_autoload``, a subpackage, and drops its mapping;
``import torch`` then fails on the missing module.)
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

BACKEND_NAME = "pycomm"  # pycomm._backend.BACKEND_NAME (this module imports nothing of pycomm)


def _create_backend(store: Any, group_rank: int, group_size: int,
                    timeout: datetime.timedelta) -> Any:
    import pycomm._backend  # raises ImportError saying how to rebuild a broken extension

    return pycomm._backend._create_backend(store, group_rank, group_size, timeout)


def register_lazily() -> None:
    """Registers "pycomm" with a creator that imports pycomm on first use; nothing when
    pycomm is registered already. Never raises: ``import torch`` must not fail here."""
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
            return
        # pycomm._backend.register's devices: CUDA tensors too under a CUDA torch.
        devices = ["cpu", "cuda"] if torch.version.cuda else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=devices)
    except Exception as err:  # torch's import must survive anything here
        logging.getLogger("pycomm").debug("pycomm: torch.backends autoload skipped: %s", err)
