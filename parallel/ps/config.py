"""A parameter-server job's settings, from the environment (as ps-lite's ``DMLC_*``).

``PS_ROLE`` (scheduler, server, worker), ``PS_SCHEDULER`` (host:port or an ipc:// path),
``PS_NUM_SERVERS``, ``PS_NUM_WORKERS``, ``PS_REPLICAS``, ``PS_CONSISTENCY`` (bsp, ssp,
async), ``PS_TAU``, ``PS_RANK`` (a worker's rank; servers are numbered as they
register), ``PS_HEARTBEAT_TIMEOUT_S``, ``PS_TIMEOUT_S``, ``PS_BIND`` (the address a
server binds: tcp://host:* or ipc://path), ``PS_ON_WORKER_DEATH`` (continue).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .consistency import MODES


@dataclass(frozen=True)
class JobConfig:
    scheduler: str
    servers: int
    workers: int
    replicas: int = 0
    consistency: str = "bsp"
    tau: int = 0
    heartbeat_timeout_s: float = 3.0
    timeout_s: float = 120.0
    on_worker_death: str = "continue"  # or "wait": for a replacement of the same rank

    def __post_init__(self) -> None:
        if self.servers < 1 or self.workers < 1:
            raise ValueError(f"ps: need >= 1 server and worker (got {self.servers}, "
                             f"{self.workers})")
        if not 0 <= self.replicas < self.servers:
            raise ValueError(f"ps: replicas must be in [0, servers - 1 = {self.servers - 1}]"
                             f", got {self.replicas}")
        if self.on_worker_death not in ("continue", "wait"):
            raise ValueError(f"ps: on_worker_death must be continue or wait, got "
                             f"{self.on_worker_death!r}")
        if self.consistency not in MODES:
            raise ValueError(f"ps: consistency must be one of {MODES}, got "
                             f"{self.consistency!r}")

    def env(self) -> dict[str, str]:
        return {"PS_SCHEDULER": self.scheduler, "PS_NUM_SERVERS": str(self.servers),
                "PS_NUM_WORKERS": str(self.workers), "PS_REPLICAS": str(self.replicas),
                "PS_CONSISTENCY": self.consistency, "PS_TAU": str(self.tau),
                "PS_HEARTBEAT_TIMEOUT_S": str(self.heartbeat_timeout_s),
                "PS_TIMEOUT_S": str(self.timeout_s), "PS_ON_WORKER_DEATH": self.on_worker_death}

    @staticmethod
    def from_env() -> JobConfig:
        env = os.environ
        missing = [k for k in ("PS_SCHEDULER", "PS_NUM_SERVERS", "PS_NUM_WORKERS")
                   if k not in env]
        if missing:
            raise RuntimeError(f"ps: {', '.join(missing)} not set: start the job with "
                               "python -m pycomm.parallel.ps.launch, or set them as ps-lite's "
                               "DMLC_* (see parallel/ps/config.py)")
        return JobConfig(env["PS_SCHEDULER"], int(env["PS_NUM_SERVERS"]),
                         int(env["PS_NUM_WORKERS"]), int(env.get("PS_REPLICAS", "0")),
                         env.get("PS_CONSISTENCY", "bsp"), int(env.get("PS_TAU", "0")),
                         float(env.get("PS_HEARTBEAT_TIMEOUT_S", "3")),
                         float(env.get("PS_TIMEOUT_S", "120")),
                         env.get("PS_ON_WORKER_DEATH", "continue"))


def address(endpoint: str) -> str:
    """A ZeroMQ address from ``host:port`` or a full ``tcp://`` / ``ipc://`` one."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"
