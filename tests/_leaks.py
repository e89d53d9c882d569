"""What of /dev/shm belongs to this test run (used by conftest's leak checks and tests).

Other runs of the suite may share the machine; a pycomm segment's name carries its
creator's pid ("pycomm-<pid>-<random>"), so a name made by a live process that is not a
descendant of this one belongs to someone else and is not this run's leak. A name whose
creator is gone is a leak whoever made it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone


def foreign(name: str) -> bool:
    """Whether ``name`` was made by a live process outside this process's tree."""
    match = re.match(r"pycomm-(\d+)-", name)
    if not match:
        return False
    pid, me = int(match.group(1)), os.getpid()
    if _parent(pid) is None:
        return False  # its creator is gone: a leak, not someone else's live segment
    seen = set()
    while pid > 1 and pid not in seen:
        if pid == me:
            return False
        seen.add(pid)
        parent = _parent(pid)
        if parent is None:
            return False
        pid = parent
    return True


def pycomm_shm() -> set[str]:
    """Names in /dev/shm that belong to pycomm and not to another live run."""
    names = (p.name for p in SHM_DIR.iterdir() if p.name.startswith("pycomm"))
    return {name for name in names if not foreign(name)}
