"""Tied parameters: one ``nn.Parameter`` reached by several names (an LM head sharing the
token embedding's matrix), kept one parameter in every layout.

Inside one pipeline stage a tie stays a single parameter
(:mod:`pycomm.parallel.tensor.tied`). Across stages (the embedding on the first, the head
on the last) each stage holds a copy, as Megatron-LM's embedding group: the copies start
equal (broadcast from the first stage that holds one), their gradients are summed over
the stages that hold them (:class:`CrossStageTies`), so each stage takes the same step
and they stay equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import ParallelMesh
from ..precision import widened
from ..tensor.sharding import spec_of


class CrossStageTies:
    """The ties whose names live on several pipeline stages, and each one's group of
    this rank's copies (the same ``dp`` and ``tp`` coordinates on every such stage)."""

    def __init__(self, groups: list[list[str]], stage_of: dict[str, int], mesh: ParallelMesh):
        self.mesh = mesh
        self.ties: list[tuple[str, list[int], Any]] = []  # (canonical name, stages, group)
        pp, dp, tp = mesh.coordinates
        for names in groups:
            stages = sorted({stage_of[n] for n in names if n in stage_of})
            if len(stages) < 2:
                continue
            mine = None
            # every rank creates every group, in one order
            for d in range(mesh.size("dp")):
                for t in range(mesh.size("tp")):
                    ranks = [mesh.global_rank(s, d, t) for s in stages]
                    group = dist.new_group(ranks)
                    if (d, t) == (dp, tp) and pp in stages:
                        mine = group
            self.ties.append((names[0], stages, mine))

    def copies(self, canonical: str) -> int:
        """How many stages hold a copy of ``canonical`` (1 if it is not tied across)."""
        return next((len(s) for n, s, _ in self.ties if n == canonical), 1)

    def mine(self, names: dict[int, str], params: list[nn.Parameter]
             ) -> list[tuple[nn.Parameter, Any]]:
        """This rank's copies of cross-stage ties, each with its group."""
        by_name = {names[id(p)]: p for p in params}
        return [(by_name[n], g) for n, _, g in self.ties if g is not None and n in by_name]

    @torch.no_grad()
    def check_and_sync(self, names: dict[int, str], params: list[nn.Parameter]) -> None:
        """Every copy has one shape and split, and starts from the first stage's values.

        Raises:
            ValueError: naming the parameter, if two stages hold it in different shapes.
        """
        for p, group in self.mine(names, params):
            mine = (tuple(p.shape), str(p.dtype), tuple(vars(spec_of(p)).values()))
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
            if any(e != mine for e in everyone):
                raise ValueError(f"tied parameter {names[id(p)]}: the pipeline stages hold it "
                                 f"as {everyone} (shape, dtype, split); they must agree")
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    @torch.no_grad()
    def sum_grads(self, tensors: list[tuple[torch.Tensor, Any]]) -> None:
        """Sum each copy's gradient (or its ZeRO shard) over the stages holding it, in
        fp32 or wider (the sum of low-precision gradients would round twice)."""
        for grad, group in tensors:
            total = widened(grad)
            dist.all_reduce(total, group=group)
            grad.copy_(total)
