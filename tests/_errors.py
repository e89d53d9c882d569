"""The message a rejected call raises, for the scenarios' bad-input cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def error_message(call: Callable[[], Any],
                  expected: tuple[type[Exception], ...] = (ValueError, TypeError)) -> str:
    """``str`` of the ``expected`` exception ``call()`` raised, or "" if it raised none."""
    try:
        call()
    except expected as exc:
        return str(exc)
    return ""
