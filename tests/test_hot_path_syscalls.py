"""No system call on an op's hot path: each costs 0.1-5 us in a VM, as much as a small
op (a stat() of /proc per op once tripled a 64 KB all_reduce's time).

Two runs of the same ranks under ``strace -f -c``, one with N1 and one with N2 calls of
every fast path (tests/_hot_path_ranks.py); a system call made per op shows up as a
count that grows with N. Waiting (futex, sched_yield, sleeps) may: how long a peer takes
decides whether a rank yields or sleeps; and a wait that sleeps asks for a short time
slice while asleep (sched_getattr/sched_setattr, csrc/core/base/wait_slice.h).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WAITING = {"futex", "sched_yield", "clock_nanosleep", "nanosleep", "restart_syscall",
           "sched_getattr", "sched_setattr"}
N1, N2 = 50, 1050  # calls of each path; 8 paths


def syscall_counts(tmp_path: Path, n: int) -> dict[str, int]:
    out = tmp_path / f"strace-{n}.txt"
    init = tmp_path / f"init-{n}"
    cmd = ["strace", "-f", "-c", "-o", str(out), sys.executable,
           str(HERE / "_hot_path_ranks.py"), str(init), str(n)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        cols = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(cols) >= 5 and cols[0][0].isdigit() and cols[-1] != "total":
            counts[cols[-1]] = int(cols[3])
    return counts


@pytest.mark.skipif(shutil.which("strace") is None, reason="no strace (apt-get install strace)")
def test_no_system_call_per_op(tmp_path):
    few, many = syscall_counts(tmp_path, N1), syscall_counts(tmp_path, N2)
    ops = (N2 - N1) * 8 * 2  # paths x ranks
    grown = {name: many.get(name, 0) - few.get(name, 0) for name in many
             if name not in WAITING}
    # Anything made once per op would grow by `ops`; allow noise from start-up
    # (threads, allocations) that differs a little between runs.
    per_op = {name: d for name, d in grown.items() if d > ops // 20}
    assert not per_op, (f"system calls that grow with the number of ops ({ops} more ops): "
                        f"{per_op}; all counts at N={N2}: {many}")
