"""Competing load for a benchmark job: K processes per CPU beside the ranks.

A rank in a real job shares its core with the trainer's compute threads, data loaders
and other jobs. ``--load K`` starts K processes per CPU this job may use, each pinned to
its CPU at the ranks' priority, for the whole job:

- ``cpu``: a busy loop (takes the core, touches no memory);
- ``mem``: copies between two 64 MiB buffers, over and over (takes the core and the
  memory bandwidth the collectives need).

They are killed (the whole process group, on signals too) when the job ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

CODE = {
    "cpu": "while True:\n    pass\n",
    "mem": (
        "import numpy as np\n"
        "a = np.ones(16 << 20, dtype=np.float32)\n"
        "b = np.empty_like(a)\n"
        "while True:\n    np.copyto(b, a)\n    np.copyto(a, b)\n"
    ),
}


def describe(k: int, kind: str) -> str:
    """The note every table of a loaded job carries."""
    if not k:
        return ""
    what = "busy loop" if kind == "cpu" else "64 MiB copies"
    return f"load: {k} competing process(es) per CPU ({kind}: {what}), pinned, same priority"


def _start(cpu: int, kind: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CODE[kind]],
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own group: killed as one, never by the job's ^C
    )


@contextlib.contextmanager
def competing(k: int, kind: str) -> Iterator[list[int]]:
    """Run the body with ``k`` ``kind`` processes per CPU of this process's affinity set;
    yields their pids."""
    if kind not in CODE:
        raise ValueError(f"load kind {kind!r}: choose from {sorted(CODE)}")
    procs = [_start(cpu, kind) for cpu in sorted(os.sched_getaffinity(0)) for _ in range(k)]
    previous = signal.signal(signal.SIGTERM, _raise_exit) if procs else None
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through competing(): the load is killed
