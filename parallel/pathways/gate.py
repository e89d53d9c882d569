"""Admitting connections to a Pathways listener without letting any caller stop it.

multiprocessing's ``Listener(authkey=...)`` authenticates inside ``accept()``: one
connection with a wrong key, or one that closes during the handshake (a port scan),
raises out of it, and one that connects and says nothing blocks it for good - either
way the thread that accepts is gone and no client can attach again. Here the listener
takes no key; each accepted connection runs the same handshake (``deliver_challenge``
then ``answer_challenge``: an HMAC of a random challenge, both ways) in a thread of its
own under a deadline, and only a connection that passes it in time is admitted. What
fails or is late is closed; at most ``most_waiting`` handshakes run at once (a flood of
silent connections is closed on arrival beyond that, and each of the others at its
deadline).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

HANDSHAKE_S = 10.0  # a peer that has not authenticated by then is closed
MOST_WAITING = 64  # handshakes in progress at once


def listen(host: str = "127.0.0.1") -> Listener:
    """A listener on a free port (port 0: the kernel picks it, no race for a number),
    authenticating nothing itself: :class:`Gate` does, per connection."""
    return Listener((host, 0))


def _shut(conn: Connection) -> None:
    """Wake a thread blocked reading ``conn`` (closing the descriptor would not)."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return  # closed already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays conn's


class Gate:
    """Accepts on ``listener`` until it is closed, and hands each connection that
    authenticates with ``authkey`` within ``deadline_s`` to ``admit``."""

    def __init__(self, listener: Listener, authkey: bytes, admit: Callable[[Connection], None],
                 deadline_s: float = HANDSHAKE_S, most_waiting: int = MOST_WAITING):
        self.listener, self.authkey, self.admit = listener, authkey, admit
        self.deadline_s = deadline_s
        self._slots = threading.Semaphore(most_waiting)
        self._count = threading.Lock()
        self.refused = 0  # connections closed unadmitted (failed, late, or over the bound)

    def serve(self) -> None:
        """The accept loop (returns once the listener is closed)."""
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)
                continue
            threading.Thread(target=self._handshake, args=(conn,), daemon=True,
                             name="pw-handshake").start()

    def _handshake(self, conn: Connection) -> None:
        lock, state = threading.Lock(), {"done": False, "late": False}

        def expire() -> None:
            with lock:
                if not state["done"]:
                    state["late"] = True
                    _shut(conn)

        timer = threading.Timer(self.deadline_s, expire)
        timer.daemon = True
        timer.start()
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            passed = True
        except Exception:  # any failure of any caller: a wrong key, EOF, garbage
            passed = False
        finally:
            timer.cancel()
            with lock:
                state["done"] = True
            self._slots.release()
        if passed and not state["late"]:
            try:
                self.admit(conn)
            except Exception as e:  # the listener outlives a failing admission too
                print(f"pathways: admitting a connection failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
                self._refuse(conn)
        else:
            self._refuse(conn)

    def _refuse(self, conn: Connection) -> None:
        with self._count:
            self.refused += 1
        with contextlib.suppress(OSError):
            conn.close()
