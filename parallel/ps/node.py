"""What every parameter-server process shares: a ZeroMQ context, a DEALER to the
scheduler, and heartbeats (a thread of their own, so a long computation does not make a
live process look dead)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .._optional import missing

try:
    import zmq
except ModuleNotFoundError as err:
    raise missing("zmq", "pycomm.parallel.ps (the parameter server's ZeroMQ transport)",
                  err) from err

from . import wire
from .config import address

HEARTBEAT_S = 0.25


def dealer(ctx: zmq.Context, endpoint: str, identity: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(address(endpoint))
    return sock


def send(sock: zmq.Socket, header: dict[str, Any], tensors: list[torch.Tensor] | tuple = (),
         to: bytes | None = None) -> None:
    frames = wire.pack(header, tensors)
    sock.send_multipart([to, *frames] if to is not None else frames, copy=False)


class Heartbeat:
    """Tells the scheduler every HEARTBEAT_S seconds that ``name`` lives."""

    def __init__(self, ctx: zmq.Context, scheduler: str, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ctx, scheduler, name),
                                        daemon=True, name=f"ps-heartbeat-{name}")
        self._thread.start()

    def _run(self, ctx: zmq.Context, scheduler: str, name: str) -> None:
        sock = dealer(ctx, scheduler, f"{name}-hb")
        try:
            while not self._stop.wait(HEARTBEAT_S):
                send(sock, {"op": "heartbeat", "node": name, "t": time.time()})
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
