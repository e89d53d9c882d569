"""Train a small MLP with DistributedDataParallel over pycomm (or any backend).

Unchanged torch code: the only pycomm-specific line is ``import pycomm``, which
registers the "pycomm" backend with torch.distributed (torch's entry point would register
it at ``import torch`` too; importing it says at once when its extension does not load).

    torchrun --nproc-per-node 4 -m pycomm.examples.train_ddp
    torchrun --nproc-per-node 4 -m pycomm.examples.train_ddp --backend gloo --steps 50

(``examples/train_ddp.py`` in a checkout: the folder installs as ``pycomm.examples``.)
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="pycomm", help="torch.distributed backend (pycomm)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def make_model() -> nn.Module:
    """The same MLP on every rank (DDP would broadcast rank 0's weights anyway)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


def make_batch(step: int, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, different on every rank: targets from a fixed random teacher."""
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(rows, 32, generator=gen)
    return x, torch.tanh(x @ teacher) + 0.01 * torch.randn(rows, 8, generator=gen)


def assert_replicas_equal(model: nn.Module) -> None:
    """Every rank must hold bit-identical parameters after the same averaged updates."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    for rank, copy in enumerate(copies):
        assert torch.equal(copy, flat), f"rank {rank} parameters differ from rank {dist.get_rank()}"


def train(args: argparse.Namespace) -> None:
    """SGD steps under DDP; rank 0 prints the loss averaged over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        x, y = make_batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step:3d}  loss {mean_loss.item() / world:.5f}")
    assert_replicas_equal(model)
    if rank == 0:
        print(f"parameters identical on all {world} ranks ({args.backend})")


def main() -> None:
    args = parse_args()
    if args.backend == "pycomm":
        import pycomm  # noqa: F401  (registers the "pycomm" backend)
    dist.init_process_group(args.backend)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
