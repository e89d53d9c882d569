"""Worker programs for tests/test_ps.py, run under ``python -m pycomm.parallel.ps.launch``:
``python tests/_ps_jobs.py SCENARIO OUT_DIR``. Each worker writes ``OUT_DIR/rankR.json``.

The data of every step is a function of (worker, step) alone, so worker 0 can compute
what one process would, from the same pushes, with the same update rule, and report the
difference."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

from pycomm.parallel.ps import KVWorker, PSError
from pycomm.parallel.ps.updaters import make_updater

DIM, STEPS, SPAN = 4, 10, 40


def step_keys(worker: int, step: int) -> torch.Tensor:
    """A sorted, unique, overlapping-between-workers set of keys."""
    gen = torch.Generator().manual_seed(100 * worker + step)
    return torch.randperm(3 * SPAN, generator=gen)[:SPAN].sort().values.to(torch.int64) * 13


def step_grads(worker: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 + 100 * worker + step)
    return torch.randn(SPAN, DIM, generator=gen)


def reference(updater: dict[str, Any], workers: list[int], steps: int,
              dead_after: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
    """One process: each step's pushes summed, then one update, with the same rule."""
    rule = make_updater(updater)
    keys = torch.arange(0, 3 * SPAN * 13, 13, dtype=torch.int64)
    values = torch.zeros(len(keys), DIM)
    state = rule.init_state(len(keys), DIM)
    for step in range(steps):
        total = torch.zeros(len(keys), DIM)
        touched = torch.zeros(len(keys), dtype=torch.bool)
        for w in workers:
            if dead_after and w in dead_after and step > dead_after[w]:
                continue
            rows = torch.searchsorted(keys, step_keys(w, step))
            total.index_add_(0, rows, step_grads(w, step))
            touched[rows] = True
        rows = touched.nonzero().squeeze(1)
        rule.apply(values, state, rows, total[rows].contiguous())
    return {int(k): values[i] for i, k in enumerate(keys.tolist())}


def train(kv: KVWorker, updater: dict[str, Any], hook: Any = None, stop: int = STEPS
          ) -> tuple[int, int]:
    kv.declare("emb", DIM, updater)
    sent = 0
    for step in range(kv.clock_value, stop):  # from the restored clock, if any
        keys = step_keys(kv.rank, step)
        kv.result(kv.pull(keys, table="emb"))
        kv.wait(kv.push(keys, step_grads(kv.rank, step), table="emb"))
        sent += len(keys)
        kv.clock()
        if hook:
            hook(kv, step)
    return sent, STEPS


def final_diff(kv: KVWorker, want: dict[int, torch.Tensor]) -> float:
    keys = torch.tensor(sorted(want), dtype=torch.int64)
    got = kv.result(kv.pull(keys, table="emb"))
    return float((got - torch.stack([want[int(k)] for k in keys])).abs().max())


def scenario_bsp(kv: KVWorker, arg: str) -> dict[str, Any]:
    updater = {"name": arg, "lr": 0.1}
    sent, _ = train(kv, updater)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    return {"diff": diff, "sent": sent}


def scenario_kill_server(kv: KVWorker, arg: str) -> dict[str, Any]:
    def hook(kv: KVWorker, step: int) -> None:
        if step == 4 and kv.rank == 0:
            pids = kv.stats()["server_pids"]
            os.kill(pids[arg], signal.SIGKILL)

    updater = {"name": "adam", "lr": 0.05}
    sent, _ = train(kv, updater, hook)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    return {"diff": diff, "sent": sent}


def scenario_stop_server(kv: KVWorker, arg: str) -> dict[str, Any]:
    """As kill_server, but SIGSTOP: the server's process lives on, silent, so only its
    heartbeats tell (at the end it is killed, so the job need not wait for it)."""
    pids: dict[str, int] = {}

    def hook(kv: KVWorker, step: int) -> None:
        if step == 4 and kv.rank == 0:
            pids.update(kv.stats()["server_pids"])
            os.kill(pids[arg], signal.SIGSTOP)

    updater = {"name": "adam", "lr": 0.05}
    sent, _ = train(kv, updater, hook)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    if pids:
        os.kill(pids[arg], signal.SIGKILL)
    return {"diff": diff, "sent": sent}


def scenario_add_server(kv: KVWorker, arg: str) -> dict[str, Any]:
    def hook(kv: KVWorker, step: int) -> None:
        if step == 3 and kv.rank == 0:
            kv.add_server()

    updater = {"name": "adagrad", "lr": 0.1}
    sent, _ = train(kv, updater, hook)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    return {"diff": diff, "sent": sent}


def scenario_kill_worker(kv: KVWorker, arg: str) -> dict[str, Any]:
    def hook(kv: KVWorker, step: int) -> None:
        if step == 3 and kv.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    updater = {"name": "sgd", "lr": 0.1}
    sent, _ = train(kv, updater, hook)
    want = reference(updater, list(range(kv.num_workers)), STEPS, dead_after={1: 3})
    return {"diff": final_diff(kv, want), "sent": sent, "dead": kv.dead_workers}


def scenario_checkpoint(kv: KVWorker, arg: str) -> dict[str, Any]:
    """Train 6 of the steps, checkpointing after step 4 (``arg``: the folder); the job
    then ends, as if it had died after the checkpoint."""
    def hook(kv: KVWorker, step: int) -> None:
        if step == 3:
            kv.barrier()
            if kv.rank == 0:
                kv.checkpoint(arg)
            kv.barrier()

    updater = {"name": "adam", "lr": 0.05}
    train(kv, updater, hook, stop=6)
    return {"clock": kv.clock_value}


def scenario_restored(kv: KVWorker, arg: str) -> dict[str, Any]:
    """Started from the checkpoint: the steps after it, then the whole run's model."""
    start = kv.clock_value
    updater = {"name": "adam", "lr": 0.05}
    train(kv, updater)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    return {"diff": diff, "start": start}


def scenario_replaced_worker(kv: KVWorker, arg: str) -> dict[str, Any]:
    """Worker 1 dies in step 4, after pushing part of it; the launcher starts a
    replacement, which redoes step 4 while worker 0 waits (BSP): the model of a run
    where no one died."""
    def hook(kv: KVWorker, step: int) -> None:
        if step == 3 and kv.rank == 1 and os.environ.get("PS_INCARNATION") == "0":
            kv.push(step_keys(1, 4), step_grads(1, 4), table="emb")  # half a step, lost
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)

    updater = {"name": "sgd", "lr": 0.1}
    start = kv.clock_value
    sent, _ = train(kv, updater, hook)
    diff = final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS))
    return {"diff": diff, "sent": sent, "start": start,
            "incarnation": os.environ.get("PS_INCARNATION")}


def scenario_bad_input(kv: KVWorker, arg: str) -> dict[str, Any]:
    kv.declare("t", 3, "sgd", init="none")
    errors: dict[str, str] = {}
    cases = {
        "unsorted": lambda: kv.push(torch.tensor([5, 2]), torch.zeros(2, 3), table="t"),
        "duplicate": lambda: kv.push(torch.tensor([2, 2]), torch.zeros(2, 3), table="t"),
        "length": lambda: kv.push(torch.tensor([1, 2]), torch.zeros(5), table="t"),
        "dtype": lambda: kv.push(torch.tensor([1.0, 2.0]), torch.zeros(2, 3), table="t"),
        "undeclared": lambda: kv.push(torch.tensor([1]), torch.zeros(1, 3), table="nope"),
        "never_set": lambda: kv.wait(kv.pull(torch.tensor([7, 8]), table="t")),
        "redeclared": lambda: kv.declare("t", 4, "sgd", init="none"),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = ""
        except (ValueError, PSError) as e:
            errors[name] = str(e)
    return {"errors": errors}


def scenario_no_close(kv: KVWorker, arg: str) -> dict[str, Any]:
    """Every worker's script ends without KVWorker.close() (see main)."""
    updater = {"name": "sgd", "lr": 0.1}
    sent, _ = train(kv, updater)
    return {"diff": final_diff(kv, reference(updater, list(range(kv.num_workers)), STEPS)),
            "sent": sent}


def scenario_exit0(kv: KVWorker, arg: str) -> dict[str, Any]:
    """Worker 1 leaves by os._exit(0) once its result is written (see main): no close."""
    return scenario_no_close(kv, arg)


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else ""
    torch.set_num_threads(1)
    kv = KVWorker()
    started = time.perf_counter()
    result = globals()[f"scenario_{scenario}"](kv, arg)
    kv.barrier()
    if kv.rank == 0:
        stats = kv.stats()
        result.update(applied=stats["applied"], events=stats["events"],
                      servers=stats["servers"])
    result["seconds"] = time.perf_counter() - started
    with open(os.path.join(out, f"rank{kv.rank}.json"), "w") as f:
        json.dump(result, f)
    if scenario == "exit0" and kv.rank == 1:
        os._exit(0)  # no close, no interpreter exit
    if scenario != "no_close":
        kv.close()  # no_close: the interpreter's exit closes it


if __name__ == "__main__":
    main()
