"""``python -m pycomm.parallel.ps.launch --servers S --workers W [--replicas R] -- CMD ...``:
a parameter-server job on this host: the scheduler (in this process), S server
processes and W worker processes running CMD with ``PS_RANK`` set.

On many hosts, start each process yourself with ``PS_ROLE=scheduler|server|worker`` and
``PS_SCHEDULER=host:port`` (``python -m pycomm.parallel.ps.launch --role-from-env``), as
ps-lite's ``DMLC_ROLE``. Exits with the first failing worker's status (a worker that was
killed on purpose is reported by the scheduler, not counted).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .config import JobConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pycomm.parallel.ps.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--replicas", type=int, default=0, help="copies of each range beyond "
                   "its primary (chain of the next R servers on the ring)")
    p.add_argument("--consistency", choices=["bsp", "ssp", "async"], default="bsp")
    p.add_argument("--tau", type=int, default=0, help="ssp: the largest lead, in steps")
    p.add_argument("--scheduler", default="", help="host:port or ipc:// (default: an ipc "
                   "socket in a temporary folder)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--on-worker-death", choices=["continue", "wait"], default="continue",
                   help="go on without a dead worker, or wait for a replacement (this "
                   "launcher starts one with the same rank)")
    p.add_argument("--restore", default="", help="start from this checkpoint folder "
                   "(kv.checkpoint): the servers' rows and the workers' clock")
    p.add_argument("--role-from-env", action="store_true", help="run the one role "
                   "PS_ROLE names (multi-host)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    return p


class Job:
    """The processes of one local job; servers may be added while it runs."""

    def __init__(self, cfg: JobConfig, cmd: list[str], ipc_dir: str = ""):
        self.cfg, self.cmd, self.ipc_dir = cfg, cmd, ipc_dir
        self.env = {**os.environ, **cfg.env(), "PYTHONUNBUFFERED": "1"}
        self.servers: list[subprocess.Popen[Any]] = []
        self.workers: list[subprocess.Popen[Any]] = []
        self.incarnations: dict[int, int] = {}
        # Told when a worker process exits (rank, exit code); answers whether it counts as
        # dead (it exited before it was done: a crash, or exit 0 without KVWorker.close).
        # The exit is surer and sooner than the heartbeat timeout, and a replacement must
        # not register before its rank is known dead (the scheduler would refuse it).
        self.on_worker_exit: Callable[[int, int], bool] = lambda rank, code: code != 0
        # Told when a server process exits while the job runs (pid, exit code): a killed
        # server is known dead at once, not after its heartbeats' deadline.
        self.on_server_exit: Callable[[int, int], None] = lambda pid, code: None
        self._servers_reported: set[int] = set()

    def spawn_server(self) -> None:
        env = {**self.env, "PS_ROLE": "server"}
        if self.ipc_dir:  # one host: servers listen on IPC sockets, not TCP
            env["PS_BIND"] = f"ipc://{self.ipc_dir}/server{len(self.servers)}"
        self.servers.append(subprocess.Popen([sys.executable, "-m", "pycomm.parallel.ps.server"],
                                             env=env))

    def spawn_worker(self, rank: int) -> None:
        self.incarnations[rank] = self.incarnations.get(rank, -1) + 1
        env = {**self.env, "PS_ROLE": "worker", "PS_RANK": str(rank),
               "PS_INCARNATION": str(self.incarnations[rank])}  # 0 first, 1 a replacement
        process = subprocess.Popen(self.cmd, env=env)
        if rank < len(self.workers):  # a replacement
            self.workers[rank] = process
        else:
            self.workers.append(process)

    def gone(self, started: bool) -> str | None:
        """Why the job cannot go on: a worker exited before the job started (the others
        would wait for it), or every worker has exited."""
        codes = [w.poll() for w in self.workers]
        for server in self.servers:
            code = server.poll()
            if started and code is not None and server.pid not in self._servers_reported:
                self._servers_reported.add(server.pid)
                self.on_server_exit(server.pid, code)
        for rank, code in enumerate(codes):
            if not started or code is None:
                continue
            dead = self.on_worker_exit(rank, code)  # told whatever the policy
            if dead and self.cfg.on_worker_death == "wait":  # start its replacement
                self.spawn_worker(rank)
                codes[rank] = None
        if not started and any(c is not None for c in codes):
            return f"worker exit codes {codes} before every process registered"
        if codes and all(c is not None for c in codes):
            return f"every worker process has exited (exit codes {codes})"
        return None

    def finish(self) -> int:
        """Wait for the workers; stop every process still alive."""
        codes = [w.wait() for w in self.workers]
        for p in self.servers:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
        failed = [c for c in codes if c not in (0, -signal.SIGKILL)]
        return failed[0] if failed else 0

    def kill_all(self) -> None:
        for p in [*self.workers, *self.servers]:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role_from_env:
        return _run_role()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        build_parser().error("give the worker command after --")
    with tempfile.TemporaryDirectory(prefix="ps-") as tmp:
        cfg = JobConfig(args.scheduler or f"ipc://{tmp}/scheduler", args.servers, args.workers,
                        args.replicas, args.consistency, args.tau, args.heartbeat_timeout,
                        args.timeout, args.on_worker_death)
        from .scheduler import Scheduler

        job = Job(cfg, cmd, ipc_dir="" if args.scheduler else tmp)
        scheduler = Scheduler(cfg, restore=args.restore, spawn_server=job.spawn_server,
                              processes_gone=job.gone)
        job.on_worker_exit = scheduler.worker_exited
        job.on_server_exit = scheduler.server_exited
        try:
            for _ in range(cfg.servers):
                job.spawn_server()
            for rank in range(cfg.workers):
                job.spawn_worker(rank)
            if scheduler.run() == 2:  # a worker failed before the job could start
                job.kill_all()
                failed = [w.returncode for w in job.workers if (w.returncode or 0) > 0]
                return failed[0] if failed else 1
            return job.finish()
        finally:
            job.kill_all()


def _run_role() -> int:
    role = os.environ.get("PS_ROLE", "")
    if role == "scheduler":
        from .scheduler import Scheduler

        return Scheduler(JobConfig.from_env()).run()
    if role == "server":
        from .server import main as server_main

        server_main()
        return 0
    raise SystemExit(f"ps: PS_ROLE must be scheduler or server here (got {role!r}); a "
                     "worker is your own program, using pycomm.parallel.ps.KVWorker")


if __name__ == "__main__":
    sys.exit(main())
