"""What each rank runs for tests/test_pipeline.py (one spawn per K), and the
single-process references."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _errors import error_message as _error
from torch import nn

from pycomm.parallel.pipeline import Pipeline

WIDTH, LAYERS, ROWS = 16, 12, 10  # 10 rows: 4 and 8 micro-batches split it unevenly
MICRO = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
MODES = ("never", "always", "except_last")


class TakeX(nn.Module):
    """A first layer for dict micro-batches: ``x * scale`` (``scale`` a plain float)."""

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        return batch["x"] * batch["scale"]


def model(dropout: float = 0.0, dict_input: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [TakeX()] if dict_input else []
    for _ in range(LAYERS // 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def even_balance(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def reference(dict_input: bool = False) -> dict[str, Any]:
    net = model(dict_input=dict_input)
    x, y = data()
    loss = loss_fn(net({"x": x, "scale": 0.5} if dict_input else x), y)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in net.named_parameters()}}


def one_step(group: Any, micro: int, schedule: str, mode: str, dropout: float = 0.0,
             dict_input: bool = False) -> dict[str, Any]:
    net = model(dropout, dict_input)
    world = dist.get_world_size(group)
    pipe = Pipeline(net, even_balance(len(net), world), micro, checkpoint=mode,
                    schedule=schedule, process_group=group)
    x, y = data()
    inputs = {"x": x, "scale": 0.5} if dict_input else x
    torch.manual_seed(100 + dist.get_rank(group))  # dropout: the same draws in every mode
    loss = pipe.step(inputs if pipe.is_first else None, y if pipe.is_last else None, loss_fn)
    return {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
            "events": [(e.kind, e.micro) for e in pipe.trace()],
            "all_events": len(pipe.gather_trace())}


ROW_SEQUENCE = (10, 10, 8, 10)  # the third step's shapes differ: no stale pre-posted receive


def reference_repeated() -> dict[str, Any]:
    """Gradients summed over steps on the first ``rows`` of the data, per ROW_SEQUENCE."""
    net = model()
    x, y = data()
    for rows in ROW_SEQUENCE:
        loss_fn(net(x[:rows]), y[:rows]).backward()
    return {"grads": {n: p.grad.clone() for n, p in net.named_parameters()}}


def repeated(group: Any, schedule: str) -> dict[str, Any]:
    """Several steps on one Pipeline (receives posted ahead from the second on)."""
    net = model()
    pipe = Pipeline(net, even_balance(len(net), dist.get_world_size(group)), 4,
                    schedule=schedule, process_group=group)
    x, y = data()
    for rows in ROW_SEQUENCE:
        pipe.step(x[:rows] if pipe.is_first else None, y[:rows] if pipe.is_last else None,
                  loss_fn)
    return {"grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
            "receives": pipe.receive_stats(), "first": pipe.is_first, "last": pipe.is_last}



def bad_input(group: Any) -> dict[str, str]:
    world = dist.get_world_size(group)
    net = model()
    x, y = data()
    pipe = Pipeline(net, even_balance(len(net), world), 4, process_group=group)
    first, last = pipe.is_first, pipe.is_last
    return {
        "few_rows": _error(lambda: pipe.step(x[:2] if first else None, y[:2] if last else None,
                                             loss_fn)),
        "targets": _error(lambda: pipe.step(x if first else None, y[:7] if last else None,
                                            loss_fn)),
        "balance": _error(lambda: Pipeline(net, [1] * world, 2, process_group=group)),
        "schedule": _error(lambda: Pipeline(net, even_balance(len(net), world), 2,
                                            schedule="zigzag", process_group=group)),
    }


def run_all(world: int) -> dict[Any, Any]:
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out: dict[Any, Any] = {}
    for micro in MICRO:
        for schedule in SCHEDULES:
            for mode in MODES:
                out[("pycomm", micro, schedule, mode)] = one_step(groups["pycomm"], micro,
                                                                  schedule, mode)
            out[("gloo", micro, schedule, "except_last")] = one_step(
                groups["gloo"], micro, schedule, "except_last")
    for mode in ("never", "always"):
        out[("dropout", mode)] = one_step(groups["pycomm"], 4, "gpipe", mode, dropout=0.3)
    out["dict"] = one_step(groups["pycomm"], 4, "1f1b", "always", dict_input=True)
    for name, group in groups.items():
        for schedule in SCHEDULES:
            out[("repeated", name, schedule)] = repeated(group, schedule)
    out["bad"] = bad_input(groups["pycomm"])
    return out
