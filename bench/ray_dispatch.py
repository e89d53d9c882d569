"""Ray's own per-call dispatch overhead: the peer for parallel.pathways' controller.

One "call" sends a trivial ``f`` (it returns its input: an int, or a 4-element tensor)
to every one of ``n_actors`` actors and waits for all of them, the way a single
controller drives one step on its workers. Three ways Ray can do it:

* ``sequential``: ``ray.get([a.f.remote(x) for a in actors])`` per call;
* ``pipelined``: every actor's chain of ``n_calls`` calls submitted at once, each call's
  input the previous call's ObjectRef, then a get of the chains' last refs;
* ``compiled``: a compiled graph (``InputNode`` -> ``f`` on every actor ->
  ``MultiOutputNode``, ``experimental_compile()``), executed ``n_calls`` times (absent
  where this Ray cannot compile one; its error is reported instead).

Each is microseconds per call, the median over ``repeats`` runs (after a warm-up)::

    python -m bench.ray_dispatch --calls 1000 --actors 2 --repeats 5 --json ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pycomm.parallel._optional import require

_PURPOSE = "bench.ray_dispatch (Ray's dispatch overhead, the controller's peer)"
ray = require("ray", _PURPOSE)
WARMUP = 50


class _Echo:
    def f(self, x: Any) -> Any:
        return x


def _sequential(actors: list, x: Any, n_calls: int) -> None:
    for _ in range(n_calls):
        ray.get([a.f.remote(x) for a in actors])


def _pipelined(actors: list, x: Any, n_calls: int) -> None:
    refs = [x] * len(actors)
    for _ in range(n_calls):
        refs = [a.f.remote(ref) for a, ref in zip(actors, refs, strict=True)]
    ray.get(refs)


def _compiled_runner(actors: list) -> tuple[Callable[[Any, int], None], Any]:
    """(run(x, n_calls), the compiled graph, to tear down)."""
    dag_mod = require("ray.dag", _PURPOSE)
    with dag_mod.InputNode() as inp:
        dag = dag_mod.MultiOutputNode([a.f.bind(inp) for a in actors])
    graph = dag.experimental_compile()

    def run(x: Any, n_calls: int) -> None:
        for _ in range(n_calls):
            ray.get(graph.execute(x))

    return run, graph


def _runs_us(run: Callable[[Any, int], None], x: Any, n_calls: int, repeats: int) -> list:
    """Microseconds per call of each of ``repeats`` runs, after a warm-up."""
    run(x, min(WARMUP, n_calls))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x, n_calls)
        times.append((time.perf_counter() - start) / n_calls * 1e6)
    return times


def ray_dispatch(n_calls: int, n_actors: int, repeats: int, payload: str = "int") -> dict:
    """{mode: microseconds per call} (median over ``repeats``), and what was run."""
    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=max(n_actors, 1), log_to_driver=False)
    x: Any = 7 if payload == "int" else torch.ones(4)
    echo = ray.remote(num_cpus=0)(_Echo)
    actors = [echo.remote() for _ in range(n_actors)]
    ray.get([a.f.remote(0) for a in actors])  # all started
    out: dict[str, Any] = {"ray": ray.__version__, "calls": n_calls, "actors": n_actors,
                           "repeats": repeats, "payload": payload, "cpus": os.cpu_count()}
    runs: dict[str, list] = {}
    for name, run in (("sequential", lambda v, n: _sequential(actors, v, n)),
                      ("pipelined", lambda v, n: _pipelined(actors, v, n))):
        runs[name] = _runs_us(run, x, n_calls, repeats)
    try:
        compiled, graph = _compiled_runner(actors)
    except Exception as err:  # a Ray without compiled graphs (or not on CPU)
        out["compiled_error"] = f"{type(err).__name__}: {err}"
    else:
        runs["compiled"] = _runs_us(compiled, x, n_calls, repeats)
        graph.teardown()
    out["us_per_call"] = {name: statistics.median(us) for name, us in runs.items()}
    out["us_runs"] = runs  # every run's, to see the spread
    for actor in actors:
        ray.kill(actor)
    if owns:
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--payload", choices=("int", "tensor"), default="int")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = ray_dispatch(args.calls, args.actors, args.repeats, args.payload)
    print(f"Ray {result['ray']}: {args.calls} calls x {args.actors} actors, {args.payload}, "
          f"median of {args.repeats}")
    print(f"{'mode':<12}{'us/call':>10}{'min':>10}{'max':>10}")
    for mode, value in result["us_per_call"].items():
        runs = result["us_runs"][mode]
        print(f"{mode:<12}{value:>10.1f}{min(runs):>10.1f}{max(runs):>10.1f}")
    if "compiled_error" in result:
        print(f"compiled    (none: {result['compiled_error']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
