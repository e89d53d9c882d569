"""Memory per rank of a mixture of experts' expert parameters, gradients and optimizer
state at ep 1, 2 and 4 (dp 4) under ZeRO 0-3, measured on each rank's live tensors after
a step and set beside the formula and the planner's prediction
(:func:`pycomm.parallel.planner.memory.expert_states`). Each rank holds E / ep experts of
3 x hidden x intermediate elements per layer (SwiGLU: gate and up packed, down), with as
many gradient elements and AdamW's two moments; where edp = dp / ep ranks hold the same
experts, ZeRO 1-2 over them (2 under 3) shards the state (and at stage 2+ the gradients)
edp ways.

    python -m bench.moe_memory --out records/moe/memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pycomm.testing import RankPool

LAYERS, EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, VOCAB, DP = 2, 8, 2, 128, 256, 256, 4
LAYOUTS = [(1, 0), (2, 0), (4, 0), (2, 1), (2, 2), (2, 3), (4, 1), (4, 3)]  # (ep, zero)


def formula(ep: int, zero: int, element_bytes: int = 4) -> dict[str, int]:
    """Bytes per rank of the experts' parameters, gradients and AdamW state."""
    elements = LAYERS * (EXPERTS // ep) * 3 * HIDDEN * INTERMEDIATE
    edp = DP // ep if zero else 1
    grads = elements // edp if zero >= 2 else elements
    return {"params": elements * element_bytes, "grads": grads * element_bytes,
            "optimizer": 2 * elements // edp * element_bytes}


def _config() -> Any:
    from pycomm.parallel.models import GPTConfig

    return GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=LAYERS, n_head=4, n_embd=HIDDEN,
                     moe_experts=EXPERTS, moe_top_k=TOP_K, moe_intermediate=INTERMEDIATE)


def _model() -> Any:
    from pycomm.parallel.models import GPT

    torch.manual_seed(0)
    return GPT(_config())


def planned(ep: int, zero: int) -> dict[str, int]:
    """The planner's prediction of the same bytes (at ep 1 the experts are dense
    parameters: the planner's states of those parameters alone)."""
    from pycomm.parallel.compose.parallelize import plan_for
    from pycomm.parallel.planner.layouts import Layout
    from pycomm.parallel.planner.memory import Job, flat_states, states
    from pycomm.parallel.planner.shapes import from_model

    with torch.device("meta"):
        model = _model()
    shape = from_model(model, plan_for(model), "gpt", _config())
    job = Job(8, 25.0, "gpipe", False, 0.0)
    if ep == 1:
        experts = [p.numel for layer in shape.layers for p in layer.params if p.expert]
        out = flat_states(experts, DP, job.bucket_mb, zero)
        out.pop("end_of_backward")
        return out
    return states(shape, Layout(DP, 1, 1, zero, False, False, ep=ep), job, 0).experts


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _side_bytes(side: Any, experts: list[torch.Tensor]) -> dict[str, int]:
    """The experts' bytes held by the data side that steps them."""
    opt = side.optimizer
    if hasattr(opt, "_shards"):  # their own ZeRO over edp: its arenas and shard state
        state = [t for s in opt.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0]
        return {"params": _bytes([opt._shards.flat.buffer]),
                "grads": _bytes([opt._shards.grads.buffer]), "optimizer": _bytes(state)}
    state = [t for p in experts for t in opt.state[p].values()
             if torch.is_tensor(t) and t.shape == p.shape]
    return {"params": _bytes(experts),
            "grads": _bytes([p.grad for p in experts if p.grad is not None]),
            "optimizer": _bytes(state)}


def measure(ep: int, zero: int) -> dict[str, int]:
    """This rank's expert bytes after one step of the GPT with experts at dp 4, ``ep``."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(dp=DP, ep=ep)
    engine = parallelize(_model(), mesh, ParallelConfig(zero=zero))
    tokens = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    engine.train_step(tokens, tokens.roll(-1, 1))
    experts = [p for n, p in engine.stage.named_parameters() if ".experts." in n]
    side = getattr(engine.dp, "experts", engine.dp)
    out = _side_bytes(side, experts)
    mesh.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("records/moe/memory.json"))
    args = parser.parse_args()
    rows = []
    with RankPool(4, backend="pycomm") as pool:
        for ep, zero in LAYOUTS:
            ranks = pool.run(measure, ep, zero)
            rows.append({"ep": ep, "zero": zero, "formula": formula(ep, zero),
                         "planner": planned(ep, zero), "ranks": ranks})
    lines = [f"GPT with experts: {LAYERS} layers x {EXPERTS} experts (top-{TOP_K}), hidden "
             f"{HIDDEN}, expert intermediate {INTERMEDIATE}, fp32, AdamW; dp {DP}; MiB per "
             "rank (measured on every rank's live tensors after one step / formula / the "
             "planner's prediction)", "",
             "| ep | ZeRO | edp | expert params | gradients | optimizer state | every rank "
             "equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [" / ".join(f"{v / 2**20:.2f}" for v in (r["ranks"][0][k], r["formula"][k],
                                                        r["planner"][k]))
                 for k in ("params", "grads", "optimizer")]
        same = all(rank == r["ranks"][0] for rank in r["ranks"])
        lines.append(f"| {r['ep']} | {r['zero']} | {DP // r['ep']} | " + " | ".join(cells)
                     + f" | {same} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
