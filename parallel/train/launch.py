"""How the trainer's ranks come to be, and the command line's entry point.

- Under torchrun (``RANK`` and ``WORLD_SIZE`` set): this process is a rank (env:// init).
- Otherwise ``nproc`` ranks (default ``dp * tp * pp``) are spawned here with
  torch.multiprocessing, meeting at a TCPStore this process serves on a free local
  port; a single rank runs in this very process.

Settings that cannot work are refused before any rank starts where that is possible
(the mesh's ``pp * dp * tp != WORLD_SIZE``, config errors, a tokenizer or dataset that
cannot be used), and otherwise by every rank alike (the engine's own checks), so no rank
waits forever on one that gave up.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from ..job.config import TrainConfig, parse
from .auto import planned, planned_everywhere
from .loop import train_rank
from .sources import check_source


def _init(cfg: TrainConfig, store: dist.Store | None = None, rank: int = 0, world: int = 1
          ) -> None:
    if cfg.backend == "pycomm":
        import pycomm  # noqa: F401  (registers the backend)
    if store is None:
        dist.init_process_group(cfg.backend)  # env:// (torchrun)
    else:
        dist.init_process_group(cfg.backend, store=store, rank=rank, world_size=world)


def _rank_main(rank: int, cfg: TrainConfig, world: int, port: int) -> None:
    """A spawned rank (``rank`` first: torch.multiprocessing.spawn passes its index)."""
    _init(cfg, dist.TCPStore("127.0.0.1", port, is_master=False), rank, world)
    try:
        train_rank(cfg)
    finally:
        dist.destroy_process_group()


def launch(cfg: TrainConfig) -> None:
    """Run ``cfg`` on every rank: as one of torchrun's, or spawning them here."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _init(cfg)
        try:
            train_rank(planned_everywhere(cfg))
        finally:
            dist.destroy_process_group()
        return
    cfg = planned(cfg, cfg.nproc or cfg.layout.world)
    world = cfg.nproc or cfg.layout.world
    cfg.layout.check_world(world)  # the mesh's own message, before anything starts
    if world > 1:  # one rank runs here: its own error is as early
        check_source(cfg)
    # This process serves the rendezvous, not rank 0: a rank that raises (the engine's
    # checks raise on every rank alike) then cannot take the store away from the others,
    # who would report a lost connection instead of the error itself.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if world == 1:
        _rank_main(0, cfg, 1, store.port)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank_main, args=(cfg, world, store.port), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m pycomm.parallel.train``: parse, check, launch; 2 for a refused setting, 1
    when a spawned rank failed (its traceback printed)."""
    from torch.multiprocessing import ProcessRaisedException

    try:
        cfg = parse(argv)
        launch(cfg)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ProcessRaisedException as exc:  # carries the failing rank's traceback
        print(f"error: a rank failed{exc}", file=sys.stderr)
        return 1
    return 0
