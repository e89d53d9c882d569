"""A test rank's own side of :mod:`pycomm.testing`: join the parent's group, run the
tasks it sends, report each result or error, leave.

Standard library only at import time: the parent starts each rank by loading this file
by path (``pycomm.testing._BOOTSTRAP``), so that the rank's ``env`` is applied before
torch or pycomm is imported, and ``backend="gloo"`` never imports pycomm's extension.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection


def _send(conn: Connection, msg: tuple) -> None:
    """Pickle before sending so an unpicklable result becomes a reported error."""
    try:
        data = pickle.dumps(msg)
    except Exception as exc:  # the result, not the channel, is at fault
        data = pickle.dumps(_error_msg(exc, "pickling the result"))
    conn.send_bytes(data)


def _error_msg(exc: BaseException, stage: str = "") -> tuple:
    """Encode an exception as plain strings; ``stage`` says where it happened."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"{exc} (while {stage})" if stage else str(exc)
    return ("error", type(exc).__name__, message, tb)


def _redirect_output(log_path: str) -> None:
    """Send this rank's stdout/stderr (Python's and C++'s) to its log file.

    A forkserver child inherits the server's stdio, i.e. whatever pytest's capture
    pointed at when the server started, not the current test's.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # flush per line: a rank may end in os._exit
        reconfigure(line_buffering=True)


def _init_group(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float):
    """Join the parent's TCPStore and create the default process group."""
    if backend == "pycomm":
        import pycomm  # noqa: F401  (registers the backend)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # Ranks share this machine's cores: torch's own intra-op threads in every rank would
    # only fight the other ranks for them (4 ranks on 2 cores ran up to 4.5x slower).
    # A test that wants more sets PYCOMM_TEST_THREADS (or calls set_num_threads itself).
    torch.set_num_threads(int(os.environ.get("PYCOMM_TEST_THREADS", "1")))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    timeout = timedelta(seconds=pg_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def _run_task(data: bytes) -> tuple:
    """Unpickle (fn, args) and run it; return a message for the parent."""
    try:
        fn, args = pickle.loads(data)
        return ("result", fn(*args))
    except BaseException as exc:
        return _error_msg(exc)


def _child_main(conn: Connection, rank: int, world_size: int, port: int, backend: str,
                pg_timeout_s: float, env: dict[str, str], log_path: str) -> None:
    """A rank's life: set env, join the group, run tasks until told to stop."""
    _redirect_output(log_path)
    os.environ.update(env)
    try:
        _init_group(rank, world_size, port, backend, pg_timeout_s)
    except BaseException as exc:
        _send(conn, _error_msg(exc, "init_process_group"))
        return
    _send(conn, ("ready",))
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the parent went away: nothing left to report to
            return
        if not task:
            break
        _send(conn, _run_task(task))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
        _send(conn, ("result", None))
    except BaseException as exc:
        _send(conn, _error_msg(exc, "destroy_process_group"))
