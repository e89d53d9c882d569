"""A Pathways scheduler survives any caller (parallel/pathways/gate.py): a wrong key, a
port scan, a connection that says nothing and stays open, garbage before and after the
handshake, a first message that is no introduction - after all of them, with the silent
connection still open, a client attaches and is welcomed, and every bad connection is
closed by the scheduler."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import AuthenticationError

import pytest

from pycomm.parallel.pathways.protocol import connect, put, take
from pycomm.parallel.pathways.scheduler import IslandScheduler

KEY = b"island-key"
WAIT_S = 20.0  # what a step may take on a loaded machine; a hang would take forever


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the scheduler closes ``sock`` (read until EOF, within ``WAIT_S``)."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


@pytest.fixture
def scheduler():
    sched = IslandScheduler(0, 1, KEY)
    sched.gate.deadline_s = 1.0  # the silent connection is closed after this
    yield sched
    sched.stop()


def test_a_client_attaches_after_every_kind_of_bad_caller(scheduler):
    address = scheduler.address
    with pytest.raises(AuthenticationError):
        connect(address, b"wrong key")
    socket.create_connection(address).close()  # a port scan
    silent = socket.create_connection(address)  # says nothing, stays open
    raw = socket.create_connection(address)  # a frame of 2 GiB announced, garbage sent
    raw.sendall(b"\x7f\xff\xff\xff" + b"x" * 64)
    unpicklable = connect(address, KEY)
    unpicklable.send_bytes(b"not a pickle")
    stranger = connect(address, KEY)
    put(stranger, ("client", "seven", -1.0))  # no introduction the scheduler knows

    client = connect(address, KEY)  # while ``silent`` is still open
    put(client, ("client", 7, 1.0))
    assert client.poll(WAIT_S), "the scheduler no longer admits clients"
    assert take(client)[0] == "welcome"

    for conn in (unpicklable, stranger):
        assert conn.poll(WAIT_S)
        with pytest.raises((EOFError, OSError)):
            conn.recv_bytes()
    assert _closed_by_peer(raw) and _closed_by_peer(silent)
    client.close()


def test_a_flood_of_silent_connections_is_bounded(scheduler):
    """Beyond ``most_waiting`` handshakes at once, a connection is closed on arrival; a
    client still attaches once the silent ones time out."""
    scheduler.gate._slots = threading.Semaphore(2)
    silent = [socket.create_connection(scheduler.address) for _ in range(4)]
    assert all(_closed_by_peer(s) for s in silent)
    client = connect(scheduler.address, KEY)
    put(client, ("client", 1, 1.0))
    assert client.poll(WAIT_S) and take(client)[0] == "welcome"
    client.close()
