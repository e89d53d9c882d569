"""What each rank runs for tests/test_zero3_tiles.py: an untied HuggingFace Llama (vocabulary
64, hidden 32) at dp=2 ZeRO-3 with ``max_unit_bytes`` of 16 rows, so the embedding and the
head are 4 tiles each: checkpoints read by a layout without tiles and back, the HF export
and pretrained weights, a model built on the meta device, and the refusals."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests import _pretrained_scenarios as pretrained
from tests import _real_batch_scenarios as rb

TOKENS = rb.batch("packed", 9).tokens


def _engine(tiles: bool, device: str = "cpu", tied: bool = False, zero: int = 3,
            tp: int = 1) -> Any:
    from pycomm.parallel.compose.config import ParallelConfig
    from pycomm.parallel.compose.parallelize import parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(pp=1, dp=2 // tp, tp=tp)
    return parallelize(pretrained.llama(tied, device), mesh, ParallelConfig(
        zero=zero, max_unit_bytes=rb.TILE_BYTES if tiles else None, weight_decay=0.1,
        optimizer_kwargs={"lr": 3e-3}))


def _units(engine: Any) -> list[int]:
    return [u.full_numel for u in engine.stage.__dict__["zero3"].units]


def _trained(engine: Any, steps: int) -> Any:
    for step in range(steps):
        b = rb.batch("ignored", step)
        engine.train_step(b.tokens, b.targets)
    return engine


def _refusal(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError) as err:
        return str(err)
    return "no error"


def run_all(root: str) -> dict[str, Any]:
    """Every case on these ranks; rank 0's tensors are compared by the test."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    tiled = _trained(_engine(True), 2)
    out["tiled units"] = _units(tiled)
    tiled.save(os.path.join(root, "tiled"), {"step": 2})
    out["tiled logits"] = tiled.logits(TOKENS)
    tiled.mesh.destroy()
    whole = _engine(False)  # reads the tiled checkpoint, writes it again
    out["whole units"] = _units(whole)
    whole.load(os.path.join(root, "tiled"))
    out["whole logits"] = whole.logits(TOKENS)
    whole.save(os.path.join(root, "whole"), {"step": 2})
    whole.mesh.destroy()
    again = _engine(True, device="meta")  # and a tiled one reads that back
    again.load(os.path.join(root, "whole"))
    again.save(os.path.join(root, "tiled-again"), {"step": 2})
    again.mesh.destroy()
    if dist.get_rank() == 0:
        from transformers import AutoConfig

        from pycomm.parallel.compose.export import save_pretrained

        save_pretrained(os.path.join(root, "tiled"), AutoConfig.for_model(
            **pretrained.llama(False, "meta").config.to_dict()), os.path.join(root, "hf"))
    dist.barrier()
    from_hf = _engine(True, device="meta")
    out["read"] = from_hf.load_pretrained(os.path.join(root, "hf"))
    out["pretrained logits"] = from_hf.logits(TOKENS)
    from_hf.save(os.path.join(root, "from-meta"), {})
    from_hf.mesh.destroy()
    fresh = _engine(True, device="meta")  # the weights one process materializes
    fresh.save(os.path.join(root, "fresh"), {})
    fresh.mesh.destroy()
    out["refused"] = [_refusal(lambda: _engine(True, tied=True)),
                      _refusal(lambda: _engine(True, zero=2)),
                      _refusal(lambda: _engine(True, tp=2))]
    return out


# a Llama whose embedding and head (8000 x 64) are 11 times a block's parameters
WIDE_VOCAB = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8000,
              "max_position_embeddings": 64, "tie_word_embeddings": False}


def pool_of(cfg: Any) -> dict[str, Any]:
    """Two steps of the trainer's engine for ``cfg``: its ZeRO-3 counters, the loss."""
    from pycomm.parallel.train.loop import build

    engine, _params, _name = build(cfg)
    for step in range(2):
        data = torch.randint(0, 256, (cfg.batch_size, cfg.block_size + 1),
                             generator=torch.Generator().manual_seed(step))
        loss = engine.train_step(data[:, :-1], data[:, 1:]).loss
    stats = engine.stage3_stats()
    engine.mesh.destroy()
    return {**stats, "loss": loss}
