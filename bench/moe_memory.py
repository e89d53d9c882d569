"""Memory per rank of a mixture of experts' expert parameters, gradients and optimizer
state at ep 1, 2 and 4 (dp 4), measured on each rank's live tensors after a step and set
beside the formula: each rank holds E / ep experts of 3 x hidden x intermediate elements
per layer (SwiGLU: gate and up packed, down), with as many gradient elements and AdamW's
two moments.

    python -m bench.moe_memory --out bench/results/moe/memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pycomm.testing import RankPool

LAYERS, EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, VOCAB = 2, 8, 2, 128, 256, 256


def formula(ep: int, element_bytes: int = 4) -> dict[str, int]:
    """Bytes per rank of the experts' parameters, gradients and AdamW state."""
    elements = LAYERS * (EXPERTS // ep) * 3 * HIDDEN * INTERMEDIATE
    return {"params": elements * element_bytes, "grads": elements * element_bytes,
            "optimizer": 2 * elements * element_bytes}


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(ep: int) -> dict[str, int]:
    """This rank's expert bytes after one step of the GPT with experts at dp 4, ``ep``."""
    from parallel.compose.mesh import ParallelMesh
    from parallel.compose.parallelize import ParallelConfig, parallelize
    from parallel.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=LAYERS, n_head=4,
                          n_embd=HIDDEN, moe_experts=EXPERTS, moe_top_k=TOP_K,
                          moe_intermediate=INTERMEDIATE))
    mesh = ParallelMesh(dp=4, ep=ep)
    engine = parallelize(model, mesh, ParallelConfig())
    tokens = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    engine.train_step(tokens, tokens.roll(-1, 1))
    experts = [p for n, p in engine.stage.named_parameters() if ".experts." in n]
    state = [t for p in experts for t in engine.optimizer.state[p].values()
             if torch.is_tensor(t) and t.shape == p.shape]
    out = {"params": _bytes(experts), "grads": _bytes([p.grad for p in experts
                                                         if p.grad is not None]),
           "optimizer": _bytes(state)}
    mesh.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/moe/memory.json"))
    args = parser.parse_args()
    rows = []
    with RankPool(4, backend="pycomm") as pool:
        for ep in (1, 2, 4):
            ranks = pool.run(measure, ep)
            rows.append({"ep": ep, "formula": formula(ep), "ranks": ranks})
    lines = [f"GPT with experts: {LAYERS} layers x {EXPERTS} experts (top-{TOP_K}), hidden "
             f"{HIDDEN}, expert intermediate {INTERMEDIATE}, fp32, AdamW; dp 4; MiB per rank "
             "(measured on every rank's live tensors after one step / formula)", "",
             "| ep | expert params | gradients | optimizer state | every rank equal |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['ranks'][0][k] / 2**20:.2f} / {r['formula'][k] / 2**20:.2f}"
                 for k in ("params", "grads", "optimizer")]
        same = all(rank == r["ranks"][0] for rank in r["ranks"])
        lines.append(f"| {r['ep']} | " + " | ".join(cells) + f" | {same} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
