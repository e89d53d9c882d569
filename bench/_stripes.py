"""pycomm's striped all_reduce (``PYCOMM_STRIPES``) as a setting of its columns.

A striped group cuts an all_reduce of at least ``PYCOMM_STRIPE_BYTES`` (4 MiB by
default) over several communicators per rank, each on its own thread
(csrc/torch/backend/stripes.h): opt-in, as gloo's thread count is a gloo user's setting.
With ``--tuned`` the columns ``pycomm`` and ``pycomm-api`` get striped twins
(``pycomm+stripes4``, ``pycomm+stripes8``); all are one family (bench._best), the best
per size counts, and a twin counts only at sizes it stripes: below them it runs the same
code as its plain column, and a second sample of one setting is not a second setting.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from unittest.mock import patch

SETTINGS = {"stripes4": 4, "stripes8": 8}  # label suffix -> PYCOMM_STRIPES
ENTRIES = ("pycomm", "pycomm-api")  # the columns that get a striped twin
STRIPE_BYTES = 4 << 20  # PYCOMM_STRIPE_BYTES' default: the least all_reduce striped


def split(label: str) -> tuple[str, str]:
    """("pycomm-api", "stripes4") for "pycomm-api+stripes4"; (label, "") without one."""
    base, _, setting = label.partition("+")
    return base, setting


def with_striped_twins(backends: list[str]) -> list[str]:
    """Each entry of ENTRIES followed by its striped twins, once."""
    out: list[str] = []
    for b in backends:
        out.append(b)
        if b in ENTRIES:
            out += [f"{b}+{s}" for s in SETTINGS if f"{b}+{s}" not in backends]
    return out


def counts_at(label: str, nbytes: int) -> bool:
    """Whether a row of ``label`` at ``nbytes`` measures a setting of its own."""
    setting = split(label.split("@")[0])[1]
    return not setting.startswith("stripes") or nbytes >= STRIPE_BYTES


def group_settings(label: str) -> AbstractContextManager:
    """The environment a striped twin's group is created in (rank 0's applies)."""
    setting = split(label)[1]
    if not setting:
        return nullcontext()
    return patch.dict(os.environ, {"PYCOMM_STRIPES": str(SETTINGS[setting])})
