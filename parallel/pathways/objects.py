"""A worker's objects: the shards its functions produced, until the controller lets go.

An object is either a value or the error that stands in for it (the function that was
to make it failed): whoever waits on it gets the error, naming where it came from. A
callback registered before the object exists runs when it arrives (a send to another
worker, a fetch by the controller); an object released before it exists is not kept.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .protocol import Key


class ObjectError(RuntimeError):
    """An object that stands for a failure: its function failed, or its transfer did."""


class Objects:
    """Values and errors by key, with waiting and callbacks on arrival."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._values: dict[Key, Any] = {}
        self._errors: dict[Key, str] = {}
        self._callbacks: dict[Key, list[Callable[[Any, str | None], None]]] = {}
        self._released: set[Key] = set()

    def put(self, key: Key, value: Any) -> None:
        self._arrive(key, value, None)

    def fail(self, key: Key, error: str) -> None:
        self._arrive(key, None, error)

    def _arrive(self, key: Key, value: Any, error: str | None) -> None:
        with self._lock:
            callbacks = self._callbacks.pop(key, [])
            if key in self._released:
                self._released.discard(key)
            elif error is None:
                self._values[key] = value
            else:
                self._errors[key] = error
            self._lock.notify_all()
        for callback in callbacks:
            _safely(callback, value, error)

    def when_ready(self, key: Key, callback: Callable[[Any, str | None], None]) -> None:
        """``callback(value, error)`` now if the object exists, else when it arrives."""
        with self._lock:
            if key not in self._values and key not in self._errors:
                self._callbacks.setdefault(key, []).append(callback)
                return
            value, error = self._values.get(key), self._errors.get(key)
        _safely(callback, value, error)

    def get(self, key: Key, timeout_s: float) -> Any:
        """The value; ObjectError if it stands for a failure or does not come in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while key not in self._values and key not in self._errors:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ObjectError(f"object {key} did not arrive within {timeout_s:g} s")
                self._lock.wait(min(left, 1.0))
            if key in self._errors:
                raise ObjectError(self._errors[key])
            return self._values[key]

    def release(self, keys: list[Key]) -> None:
        """Forget these objects (or, for one not yet made, not keep it when it comes)."""
        with self._lock:
            for key in keys:
                found = key in self._values or key in self._errors
                self._values.pop(key, None)
                self._errors.pop(key, None)
                if not found:  # still to come: drop it on arrival
                    self._released.add(key)

    def release_client(self, client: int) -> None:
        """Forget every object of ``client`` (it left the cluster)."""
        with self._lock:
            for store in (self._values, self._errors):
                for key in [k for k in store if k[0] == client]:
                    del store[key]
            self._released = {k for k in self._released if k[0] != client}

    def __len__(self) -> int:
        with self._lock:
            return len(self._values) + len(self._errors)


def _safely(callback: Callable[[Any, str | None], None], value: Any, error: str | None) -> None:
    """A callback that raises (a reply that does not pickle, a peer gone) must not take
    down the thread that stored the object."""
    try:
        callback(value, error)
    except Exception as e:
        print(f"pathways: an object's callback failed: {type(e).__name__}: {e}",
              file=sys.stderr)
