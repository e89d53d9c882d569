"""``--plan auto``: the trainer takes the layout :mod:`pycomm.parallel.planner` ranks first for its
ranks and memory (the fastest predicted that fits), in place of dp, tp, pp, zero,
recompute and partition_activations. Without it, ``--memory-gb`` checks the layout
given against the limit (:mod:`pycomm.parallel.planner.fit`: refused with its predicted peak, or
with ZeRO-3 offload the read-ahead and live budget picked to fit). Under torchrun rank
0 plans and every rank takes its choice (ranks measuring on their own could choose
differently and never meet)."""

from __future__ import annotations

import dataclasses
import sys

import torch.distributed as dist

from ..job.config import TrainConfig


def planned(cfg: TrainConfig, world: int) -> TrainConfig:
    """``cfg`` with the planner's best layout for ``world`` ranks; without ``--plan
    auto``, ``cfg`` as it fits in ``--memory-gb`` (``cfg`` itself without either).

    Raises:
        ValueError: no layout fits in the memory (the planner names the smallest need).
    """
    if cfg.plan != "auto":
        return fitted(cfg) if cfg.memory_gb else cfg
    from ..planner.cli import memory_gib
    from ..planner.layouts import with_layout
    from ..planner.planner import GIB, choose

    limit = memory_gib(cfg.memory_gb, world)
    row = choose(dataclasses.replace(cfg, nproc=world, plan=""), world, limit,
                 other_load=cfg.plan_other_load)
    print(f"plan auto: {row} (predicted {row.peak / GIB:.3f} GiB per rank of "
          f"{limit:.3f}, {row.time.total:.3f} s per step)", file=sys.stderr)
    chosen = dataclasses.replace(with_layout(cfg, row.layout), **row.settings)
    chosen.check()
    return chosen


def fitted(cfg: TrainConfig) -> TrainConfig:
    """The layout given, checked against ``--memory-gb`` (its settings picked to fit)."""
    from ..planner.fit import PREDICTION_MARGIN, fit_memory
    from ..planner.planner import GIB

    chosen, mem = fit_memory(cfg, cfg.memory_gb)
    changed = [f"--{f.replace('_', '-')} {getattr(chosen, f):g}"
               for f in ("offload_prefetch", "max_live_mb", "max_unit_mb")
               if getattr(chosen, f) != getattr(cfg, f)]
    print(f"memory: predicted {mem.peak / GIB:.3f} GiB per rank of --memory-gb "
          f"{cfg.memory_gb:g} ({PREDICTION_MARGIN:.0%} kept)"
          + (f" at {' '.join(changed)}" if changed else ""),
          file=sys.stderr)
    return chosen


def planned_everywhere(cfg: TrainConfig) -> TrainConfig:
    """:func:`planned` on rank 0, the same layout on every rank (the group is up).

    Raises:
        ValueError: on every rank alike, what rank 0's planning raised (no layout fits,
            a layout that does not fit): the others do not wait for a broadcast that
            never comes.
    """
    if cfg.plan != "auto" and not cfg.memory_gb:
        return cfg
    box: list[TrainConfig | str | None] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = planned(cfg, dist.get_world_size())
        except ValueError as err:
            box[0] = str(err)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    assert box[0] is not None
    return box[0]
