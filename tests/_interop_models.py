"""Models, data and single-process references shared by the torch interop scenarios.

Everything here is deterministic from a seed, so a rank process and the pytest
process build bit-identical models and batches without talking to each other.
"""

import torch
from torch import nn

IN_DIM, HIDDEN, OUT_DIM = 16, 64, 5  # OUT_DIM=5: FSDP2 pads the odd-sized last shard
ROWS_PER_RANK = 8
STEPS = 5
LR, MOMENTUM, ADAM_LR = 0.05, 0.9, 1e-2


def mlp(seed: int = 0) -> nn.Sequential:
    """A four-layer MLP; with a 4 KB DDP bucket cap its gradients fill several buckets."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT_DIM),
    )


def tiny_transformer(seed: int = 0) -> nn.Module:
    """One encoder layer (no dropout, so ranks stay deterministic) and a linear head."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        d_model=IN_DIM, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    return nn.Sequential(layer, nn.Flatten(1), nn.Linear(4 * IN_DIM, OUT_DIM))


MODELS = {"mlp": mlp, "transformer": tiny_transformer}


def global_batch(step: int, world: int, model: str = "mlp") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step; rank r trains on rows [r*ROWS_PER_RANK, (r+1)*ROWS_PER_RANK)."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = ROWS_PER_RANK * world
    shape = (rows, IN_DIM) if model == "mlp" else (rows, 4, IN_DIM)
    return torch.randn(shape, generator=gen), torch.randn(rows, OUT_DIM, generator=gen)


def rank_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return t[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    """Detached CPU copies of the parameters, in registration order."""
    return [p.detach().clone() for p in model.parameters()]


def reference_run(world: int, model: str = "mlp", optim: str = "sgd", micro: int = 1) -> dict:
    """The single-process run every scenario must reproduce, on the whole batch.

    DDP and FSDP2 average per-rank mean-loss gradients, which with equal shards
    is the gradient of the global mean loss; tensor and pipeline parallelism
    compute that global gradient directly. With ``micro`` > 1 each step
    accumulates that many batches (the ``no_sync`` scenario).

    Returns:
        ``params`` after STEPS steps, the global ``losses``, and the first step's
        ``out``, input gradient ``x_grad`` and parameter gradients ``grads``.
    """
    net = MODELS[model]()
    opt = make_optimizer(net.parameters(), optim)
    result: dict = {"losses": []}
    for step in range(STEPS):
        for m in range(micro):
            x, y = global_batch(step * micro + m, world, model)
            x.requires_grad_(step == 0)
            out = net(x)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            result["losses"].append(loss.item())
            if step == 0 and m == 0:
                result["out"], result["x_grad"] = out.detach(), x.grad
        if step == 0:
            result["grads"] = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    result["params"] = params_of(net)
    return result


def make_optimizer(params, optim: str) -> torch.optim.Optimizer:
    """SGD with momentum or Adam, with the hyper-parameters every run shares."""
    if optim == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
