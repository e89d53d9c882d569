"""Run a function on N fresh ranks (real processes over a TCPStore) for multi-rank tests.

Two entry points share one mechanism:

- ``run_ranks(fn, world_size, *args)`` spawns the ranks, runs ``fn`` once, tears down.
- ``RankPool(world_size)`` keeps the ranks (and their process group) alive so many
  cases cost one spawn; ``pool.run(fn, *args)`` runs a case on every rank.

``fn`` must be a module-level function (it is pickled by reference). Each rank's
return value comes back to the parent; exceptions come back as strings (type name,
message, formatted traceback) so an unpicklable exception cannot break reporting.
Any failure raises :class:`RankFailure`, which lists every failing rank.

Example::

    def _sum(n):
        t = torch.ones(n)
        dist.all_reduce(t)
        return t.tolist()

    assert run_ranks(_sum, 2, 3, backend="gloo") == [[2.0] * 3] * 2

This module imports only the standard library at import time, and so does the rank's
side (``pycomm/_test_rank.py``), which each child loads by file path (see
``_BOOTSTRAP``) so that its ``env`` is applied before pycomm is imported, and so that
``backend="gloo"`` never imports pycomm's extension. Each
rank's stdout/stderr goes to a log that the parent echoes to its own stderr (so
pytest shows it for a failing test) and quotes in :class:`RankFailure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

# Extra seconds a rank gets, beyond the group timeout, to report after another rank
# failed: its own collective must first time out and raise, and that error is the
# information the test wants (which rank/op/seq it was stuck on).
_REPORT_SLACK_S = 10.0
_JOIN_S = 30.0  # a rank that returned must exit (destroy its group) within this
_CLEANUP_S = 10.0  # after a failure, time for answering ranks to destroy their group
_OUTPUT_TAIL = 4000  # characters of a failing rank's output quoted in RankFailure
_LIVE_PIDS: set[int] = set()  # ranks of every started, not yet closed pool

# A spawned child starts by running this instead of importing ``pycomm._test_rank``:
# importing the package would run pycomm/__init__.py, which imports torch, before the
# rank's env (OMP_NUM_THREADS and the like) is applied.
_RANK_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_test_rank.py")
_BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_pycomm_rank", path)
module = importlib.util.module_from_spec(spec)
sys.modules["_pycomm_rank"] = module
spec.loader.exec_module(module)
module._child_main(**kwargs)
"""


def live_rank_pids() -> set[int]:
    """Pids of ranks owned by open pools (a leak check must not count these)."""
    return set(_LIVE_PIDS)


@contextlib.contextmanager
def held_store(world_size: int, timeout_s: float = 120.0):
    """A TCPStore held by this process on a port the kernel picked; yields the port.

    Ranks started inside the block join it as clients (``is_master=False``). Unlike a
    port picked free and bound later by a rank, nothing else on the host can take it in
    between.
    """
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


@dataclass(frozen=True)
class RankError:
    """Why one rank failed.

    ``kind`` is "raised" (fn or group setup raised), "died" (exited without a
    result), "timeout" (no answer before the deadline) or "killed" (still running
    after another rank failed, so it was stopped).
    """

    rank: int
    kind: str
    type_name: str = ""
    message: str = ""
    traceback: str = ""
    output: str = ""  # the end of what the rank printed during this run

    def describe(self) -> str:
        """One header line, then the traceback and the rank's output, if any."""
        head = f"rank {self.rank}: {self.kind}"
        if self.type_name:
            head += f": {self.type_name}: {self.message}"
        elif self.message:
            head += f": {self.message}"
        if self.traceback:
            head += "\n" + self.traceback.rstrip()
        if self.output.strip():
            head += f"\n  output of rank {self.rank}:\n" + self.output.rstrip()
        return head


class RankFailure(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> :class:`RankError`."""

    def __init__(self, failures: dict[int, RankError], world_size: int, what: str = "fn"):
        self.failures = dict(sorted(failures.items()))
        lines = [f"{len(failures)} of {world_size} ranks failed ({what}):"]
        lines += ["--- " + err.describe() for err in self.failures.values()]
        super().__init__("\n".join(lines))


def _exit_text(exitcode: int | None) -> str:
    """Describe a process exit code, naming the signal for negative codes."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode} without a result"


# ---------------------------------------------------------------------------- parent


def _collect(procs: list, conns: list[Connection], deadline: float, grace_s: float,
             timeout_s: float) -> tuple[dict[int, Any], dict[int, RankError]]:
    """Wait for one message from every rank; return (results, failures).

    After the first failure the others get ``grace_s`` more to report; a rank that
    is still silent then is "killed" (or "timeout" if the deadline came first).
    """
    results: dict[int, Any] = {}
    failures: dict[int, RankError] = {}
    pending = set(range(len(procs)))
    limit = deadline
    while pending and time.monotonic() < limit:
        handles = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        wait(handles, timeout=max(0.0, limit - time.monotonic()))
        for rank in sorted(pending):
            msg = _poll(procs[rank], conns[rank])
            if msg is None:
                continue
            pending.discard(rank)
            if msg[0] == "error":
                failures[rank] = RankError(rank, "raised", *msg[1:])
            elif msg[0] == "died":
                failures[rank] = RankError(rank, "died", message=msg[1])
            else:
                results[rank] = msg[1] if len(msg) > 1 else None
        if failures and limit == deadline:  # first failure: start the grace period
            limit = min(deadline, time.monotonic() + grace_s)
    for rank in pending:
        if failures:
            note = f"no answer {grace_s:.0f} s after another rank failed; stopped"
            failures[rank] = RankError(rank, "killed", message=note)
        else:
            failures[rank] = RankError(rank, "timeout", message=f"no answer in {timeout_s} s")
    return results, failures


def _poll(proc: Any, conn: Connection) -> tuple | None:
    """The rank's message if one is ready, ("died", why) if it exited, else None."""
    msg = _ready_message(conn)
    if msg is not None or proc.is_alive():
        return msg
    proc.join()
    # A rank may send its last message and exit between the read above and the liveness
    # check (the shutdown's answer always is): only an exit with nothing in the pipe died.
    return _ready_message(conn) or ("died", _exit_text(proc.exitcode))


def _ready_message(conn: Connection) -> tuple | None:
    """The message waiting in ``conn``, or None (none yet, or the pipe is closed)."""
    try:
        if conn.poll():
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass
    return None


def _stop(procs: list, grace_s: float = 2.0) -> None:
    """Terminate, then kill, every process still alive, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _context(env: dict[str, str]) -> Any:
    """The multiprocessing context for ranks (never plain fork of a process running torch).

    "forkserver" with torch preloaded starts 4 ranks in ~0.15 s instead of ~3 s with
    "spawn" (on 2 cores), but torch is then imported before ``env`` is applied. That
    is harmless for PYCOMM_* variables (pycomm is imported after ``env``); any other
    variable might be read by torch at import, so such an ``env`` gets "spawn".
    """
    if all(key.startswith("PYCOMM_") for key in env):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])  # no effect once the server is running
        return ctx
    return mp.get_context("spawn")


class RankPool:
    """Persistent ranks with an initialised default group, for running many cases.

    Ranks start on the first :meth:`run`. If a case fails, the ranks are stopped
    (their group may be half way through an aborted collective) and the next
    :meth:`run` starts fresh ones.

    Args:
        world_size: number of ranks.
        backend: torch.distributed backend; "pycomm" makes each rank ``import pycomm``.
        pg_timeout_s: the process group's timeout.
        env: environment variables set in each rank before pycomm is imported, and
            before torch too unless every name starts with PYCOMM_ (see ``_context``).
        rank_env: rank -> variables set in that rank only, after ``env`` (ranks started
            with different settings, as a misconfigured job would be); same rules.

    Example::

        with RankPool(2, backend="gloo") as pool:
            assert pool.run(_rank_and_size) == [(0, 2), (1, 2)]
    """

    def __init__(self, world_size: int, backend: str = "pycomm", pg_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None,
                 rank_env: dict[int, dict[str, str]] | None = None):
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.env = dict(env or {})
        self.rank_env = {rank: dict(v) for rank, v in (rank_env or {}).items()}
        self._procs: list = []
        self._conns: list[Connection] = []
        self._store: Any = None
        self._ready = False
        self._log_dir = ""
        self._log_offsets: list[int] = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        """Create a fresh TCPStore and spawn one process per rank."""
        import torch.distributed as dist

        # Port 0: the store binds a free port itself, so no race with other tests.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                    wait_for_workers=False)
        envs = [{**self.env, **self.rank_env.get(rank, {})} for rank in range(self.world_size)]
        ctx = _context({key: "" for env in envs for key in env})
        self._log_dir = tempfile.mkdtemp(prefix="pycomm-ranks-")
        self._log_offsets = [0] * self.world_size
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            kwargs = dict(conn=child_conn, rank=rank, world_size=self.world_size,
                          port=self._store.port, backend=self.backend,
                          pg_timeout_s=self.pg_timeout_s, env=envs[rank],
                          log_path=self._log_path(rank))
            bootstrap = (_BOOTSTRAP, {"path": _RANK_FILE, "kwargs": kwargs})
            proc = ctx.Process(target=exec, args=bootstrap, name=f"pycomm-rank{rank}",
                               daemon=True)
            proc.start()
            _LIVE_PIDS.add(proc.pid)
            child_conn.close()  # so the parent sees EOF when the child dies
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._ready = False

    def _gather(self, deadline: float, timeout_s: float, what: str) -> list:
        """One message from every rank, ordered by rank; on failure stop all, raise."""
        grace_s = self.pg_timeout_s + _REPORT_SLACK_S
        results, failures = _collect(self._procs, self._conns, deadline, grace_s, timeout_s)
        output = self._drain_logs()
        for rank, err in failures.items():
            failures[rank] = dataclasses.replace(err, output=output[rank][-_OUTPUT_TAIL:])
        if failures:
            # Ranks that answered are idle: let them destroy their group (that path
            # must work after a failure too) instead of killing them mid-cleanup.
            idle = [r for r in range(self.world_size) if r in results
                    or failures[r].kind == "raised"]
            self._teardown(graceful=idle)
            raise RankFailure(failures, self.world_size, what)
        return [results[rank] for rank in range(self.world_size)]

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def _drain_logs(self) -> list[str]:
        """Each rank's new output; also echoed, prefixed, to this process's stderr."""
        texts = []
        for rank, offset in enumerate(self._log_offsets):
            data = b""
            with contextlib.suppress(OSError), open(self._log_path(rank), "rb") as log:
                log.seek(offset)
                data = log.read()
            self._log_offsets[rank] = offset + len(data)
            text = data.decode(errors="replace")
            sys.stderr.writelines(f"[rank {rank}] {line}\n" for line in text.splitlines())
            texts.append(text)
        return texts

    def _ensure_ready(self, deadline: float, timeout_s: float) -> None:
        """Start the ranks if needed and wait until every rank has joined the group."""
        if not self._procs:
            self._start()
        if not self._ready:
            self._gather(deadline, timeout_s, "init_process_group")
            self._ready = True

    def _broadcast(self, data: bytes) -> None:
        """Send a task to every rank; a dead rank is noticed by the next _gather."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(data)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0) -> list:
        """Run ``fn(*args)`` on every rank and return the results ordered by rank.

        Raises:
            RankFailure: a rank raised, died, or did not answer within ``timeout_s``.
        """
        data = pickle.dumps((fn, args))  # a lambda fails here, before any rank runs
        deadline = time.monotonic() + timeout_s
        self._ensure_ready(deadline, timeout_s)
        self._broadcast(data)
        return self._gather(deadline, timeout_s, getattr(fn, "__name__", "fn"))

    def close(self) -> None:
        """Destroy the group on every rank and reap the processes.

        Raises:
            RankFailure: a rank failed to start or to shut down cleanly.
        """
        if not self._procs:
            return
        deadline = time.monotonic() + self.pg_timeout_s + _JOIN_S
        self._ensure_ready(deadline, self.pg_timeout_s + _JOIN_S)
        self._broadcast(b"")  # empty task = shut down
        self._gather(deadline, _JOIN_S, "destroy_process_group")
        hung = {}
        for rank, proc in enumerate(self._procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                hung[rank] = RankError(rank, "timeout", message="did not exit after shutdown")
        self._teardown()
        if hung:
            raise RankFailure(hung, self.world_size, "process exit")

    def _teardown(self, graceful: list[int] | tuple[int, ...] = ()) -> None:
        """Stop every rank and forget them; the next run() starts fresh ones.

        Ranks in ``graceful`` are first asked to shut down (destroying their group);
        whatever is still alive after ``_CLEANUP_S`` is terminated, then killed.
        """
        end = time.monotonic() + _CLEANUP_S
        for rank in graceful:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conns[rank].send_bytes(b"")
        for rank in graceful:
            self._procs[rank].join(max(0.0, end - time.monotonic()))
        _stop(self._procs)
        _LIVE_PIDS.difference_update(proc.pid for proc in self._procs)
        for conn in self._conns:
            conn.close()
        if self._log_dir:
            self._drain_logs()  # what the ranks printed while shutting down
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = ""
        self._procs, self._conns, self._store, self._ready = [], [], None, False


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "pycomm",
              timeout_s: float = 180.0, pg_timeout_s: float = 60.0,
              env: dict[str, str] | None = None,
              rank_env: dict[int, dict[str, str]] | None = None) -> list:
    """Run ``fn(*args)`` once on ``world_size`` fresh ranks; results ordered by rank.

    Each rank applies ``env`` (then its entry of ``rank_env``), joins a fresh TCPStore,
    calls ``init_process_group`` (importing pycomm first when ``backend == "pycomm"``),
    runs ``fn`` and calls ``destroy_process_group``. No process outlives the call.

    Raises:
        RankFailure: listing every rank that raised, died, or timed out.
    """
    pool = RankPool(world_size, backend=backend, pg_timeout_s=pg_timeout_s, env=env,
                    rank_env=rank_env)
    try:
        results = pool.run(fn, *args, timeout_s=timeout_s)
    except BaseException:
        pool._teardown()
        raise
    pool.close()
    return results
