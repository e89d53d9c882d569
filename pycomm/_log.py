"""PYCOMM_DEBUG logging from Python, through the C++ core's logger.

One implementation for both languages: the same variables (``PYCOMM_DEBUG``,
``PYCOMM_DEBUG_SUBSYS``, ``PYCOMM_DEBUG_FILE``), the same line format
(``host:pid:tid [rank] PYCOMM INFO ...``) and the same file. Needs ``pycomm._C``; the
callers log after the extension has been loaded.
"""

from __future__ import annotations

from pycomm._extension import load as _extension


def enabled(level: str, subsys: str) -> bool:
    """Whether a line of ``level`` (WARN, INFO, TRACE) about ``subsys`` would be printed.

    Raises:
        ValueError: PYCOMM_DEBUG or PYCOMM_DEBUG_SUBSYS holds a value it does not take.
    """
    return bool(_extension()._log_enabled(level, subsys))


def log(level: str, subsys: str, rank: int, msg: str) -> None:
    """Logs ``msg`` for ``rank`` as the C++ core does, if the settings let it out."""
    _extension()._log(level, subsys, rank, msg)


def info(subsys: str, rank: int, msg: str) -> None:
    log("INFO", subsys, rank, msg)


def warn(subsys: str, rank: int, msg: str) -> None:
    log("WARN", subsys, rank, msg)
