"""``--plan auto``: the trainer takes the layout :mod:`parallel.plan` ranks first for its
ranks and memory (the fastest predicted that fits), in place of dp, tp, pp, zero,
recompute and partition_activations. Under torchrun rank 0 plans and every rank takes
its choice (ranks measuring on their own could choose differently and never meet)."""

from __future__ import annotations

import dataclasses
import sys

import torch.distributed as dist

from parallel.train.config import TrainConfig


def planned(cfg: TrainConfig, world: int) -> TrainConfig:
    """``cfg`` with the planner's best layout for ``world`` ranks (``cfg`` itself without
    ``--plan auto``).

    Raises:
        ValueError: no layout fits in the memory (the planner names the smallest need).
    """
    if cfg.plan != "auto":
        return cfg
    from parallel.plan.cli import memory_gib
    from parallel.plan.layouts import with_layout
    from parallel.plan.planner import GIB, choose

    limit = memory_gib(cfg.memory_gb, world)
    row = choose(dataclasses.replace(cfg, nproc=world, plan=""), world, limit,
                 other_load=cfg.plan_other_load)
    print(f"plan auto: {row.layout} (predicted {row.peak / GIB:.3f} GiB per rank of "
          f"{limit:.3f}, {row.time.total:.3f} s per step)", file=sys.stderr)
    chosen = with_layout(cfg, row.layout)
    chosen.check()
    return chosen


def planned_everywhere(cfg: TrainConfig) -> TrainConfig:
    """:func:`planned` on rank 0, the same layout on every rank (the group is up)."""
    if cfg.plan != "auto":
        return cfg
    box = [planned(cfg, dist.get_world_size()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]
