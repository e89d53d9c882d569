"""How many places the model passes through inside ``parallelize``: every call, during
``parallelize(model, mesh, config)``, of a function of pycomm's strategies that receives
the model itself as an argument, in call order, by file. A *return* is a stop in a file
the walk had already left (the package's layering reads as one pass when it has none;
torchtitan's ``parallelize_llama`` visits each strategy once, in order).

    python -m bench.parallelize_walk [--zero 3] [--tp 1] [--recompute] [--offload disk]

One process (world 1, gloo), the project's GPT; prints the stops and the counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from pycomm.parallel.compose import ParallelConfig, ParallelMesh, parallelize
from pycomm.parallel.models import GPT, GPTConfig


def walk(config_kwargs: dict) -> list[str]:
    """The files (relative to parallel/) of every call that received the model."""
    package_root = Path(sys.modules[parallelize.__module__].__file__).resolve().parents[1]
    model = GPT(GPTConfig())
    mesh = ParallelMesh()
    stops: list[str] = []

    def profile(frame, event, arg):  # sys.setprofile's signature
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if package_root not in path.parents:
            return
        if any(value is model for value in frame.f_locals.values()):
            stops.append(f"{path.relative_to(package_root)}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        parallelize(model, mesh, ParallelConfig(**config_kwargs))
    finally:
        sys.setprofile(None)
    return stops


def returns(stops: list[str]) -> int:
    """Stops in a file the walk had left before."""
    left: set[str] = set()
    count, previous = 0, None
    for stop in stops:
        file = stop.split(":")[0]
        if file != previous and file in left:
            count += 1
        if previous is not None and file != previous:
            left.add(previous)
        previous = file
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--offload", default="none", choices=("none", "disk", "cpu"))
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    kwargs: dict = {"zero": args.zero, "recompute": args.recompute}
    with tempfile.TemporaryDirectory() as tmp:
        if args.offload != "none":
            kwargs.update(offload=args.offload, offload_dir=tmp)
        stops = walk(kwargs)
    dist.destroy_process_group()
    for stop in stops:
        print(stop)
    files = {s.split(":")[0] for s in stops}
    print(f"# {len(stops)} stops in {len(files)} files, {returns(stops)} returns "
          f"(zero {args.zero}, recompute {args.recompute}, offload {args.offload})")


if __name__ == "__main__":
    main()
