"""A free TCP port for a job's rendezvous (shared by every launcher of the benchmarks)."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
