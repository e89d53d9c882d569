"""ZeRO-3 tiles (``max_unit_bytes``): a large embedding split by rows and a head by
vocabulary chunks, each tile a unit, the loss taken in the head's chunks.

One process: the tiled layers compute what the layers computed (bit for bit: the
embedding's output and weight gradient, the head's logits), the chunked cross-entropy
is ``F.cross_entropy``'s, and what cannot be tiled is refused by name. Two ranks: the
units are the tiles; a tiled checkpoint is the model's own tensors, read by a layout
without tiles and back unchanged; its HuggingFace export loads with ``from_pretrained``
and gives the engine's logits; pretrained weights and a model built on the meta device
give tiles holding the one process's weights. Real batches train as one process with
tiles in memory and offloaded under a pipeline (``tests/test_real_batches.py``)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pycomm.parallel.compose.chunked_loss import chunked_cross_entropy
from pycomm.parallel.compose.tiles import row_bounds, tiled


@pytest.mark.parametrize("rows,per_row,most", [(64, 32, 512), (1000, 7, 700), (5, 3, 1),
                                               (32000, 2048, 1 << 24), (10, 4, 1000)])
def test_row_bounds_cover_the_rows_in_tiles_no_larger_than_asked(rows, per_row, most):
    bounds = row_bounds(rows, per_row, most)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert all(s * per_row <= most for s in sizes) or max(sizes) == 1


def test_a_tiled_embedding_is_the_embedding_bit_for_bit():
    torch.manual_seed(0)
    whole = nn.Embedding(1000, 64, padding_idx=300)
    tiles = tiled(whole, "embed", 64 * 300)
    assert [(t.start, t.stop) for t in tiles.tiles] == [(0, 250), (250, 500), (500, 750),
                                                         (750, 1000)]
    ids = torch.randint(0, 1000, (4, 33))
    ids[0, :5] = 300  # padding: no gradient for its row
    ids[1, :3] = torch.tensor([0, 999, 250])  # tiles' first and last rows
    grad = torch.randn(4, 33, 64)
    want = whole(ids)
    (want * grad).sum().backward()
    got = tiles(ids)
    (got * grad).sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(torch.cat([t.weight.grad for t in tiles.tiles]), whole.weight.grad)
    assert not whole.weight.grad[300].any()


@pytest.mark.parametrize("bias", [False, True])
def test_a_tiled_head_is_the_head_bit_for_bit(bias):
    torch.manual_seed(0)
    whole = nn.Linear(64, 1000, bias=bias)
    tiles = tiled(whole, "lm_head", 65 * 300)
    x = torch.randn(4, 33, 64)
    assert torch.equal(tiles(x), whole(x))
    assert tiles.bounds == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert tiled(whole, "lm_head", whole.weight.numel() * 2) is None  # small enough


def _targets(shape: tuple[int, int], vocab: int) -> torch.Tensor:
    targets = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
    targets[0, :7] = -100  # ignored in uneven counts per row
    targets[2, -3:] = -100
    return targets


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-14), (torch.float32, 1e-6),
                                       (torch.bfloat16, 1e-6)])
def test_the_chunked_loss_is_the_cross_entropy(dtype, rel):
    """Against ``F.cross_entropy`` on the logits widened to float32 (float64 kept): the
    loss, and the gradient in the logits' own dtype."""
    logits = torch.randn(4, 33, 1000, dtype=torch.float64).to(dtype)
    targets = _targets((4, 33), 1000)
    wide = logits.to(torch.promote_types(dtype, torch.float32)).clone().requires_grad_()
    want = F.cross_entropy(wide.reshape(-1, 1000), targets.reshape(-1), reduction="sum")
    want.backward()
    mine = logits.clone().requires_grad_()
    got = chunked_cross_entropy(mine, targets, -100, [(0, 250), (250, 600), (600, 1000)])
    got.backward()
    assert got.dtype == want.dtype and mine.grad.dtype == dtype
    assert abs(got.item() / want.item() - 1) < rel
    tolerance = {torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    torch.testing.assert_close(mine.grad.float(), wide.grad.to(dtype).float(),
                               rtol=tolerance, atol=tolerance * 1e-3)


def test_the_chunked_loss_gradient_passes_gradcheck():
    targets = _targets((3, 5), 10)
    logits = torch.randn(3, 5, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda z: chunked_cross_entropy(z, targets, -100, [(0, 3), (3, 10)]), logits)


def test_the_chunked_loss_refuses_a_target_outside_the_vocabulary_and_bad_chunks():
    logits = torch.randn(2, 3, 10)
    targets = torch.zeros(2, 3, dtype=torch.long)
    targets[1, 2] = 10
    with pytest.raises(ValueError, match=r"target 10 is outside the vocabulary \[0, 10\)"):
        chunked_cross_entropy(logits, targets, -100, [(0, 10)])
    with pytest.raises(ValueError, match="do not cover the vocabulary of 10"):
        chunked_cross_entropy(logits, targets.clamp(max=9), -100, [(0, 4), (5, 10)])


@pytest.mark.parametrize("module,what", [
    (nn.Embedding(100, 8, max_norm=1.0), "Embedding"),
    (nn.Embedding(100, 8, scale_grad_by_freq=True), "Embedding"),
    (nn.Conv1d(8, 100, 3), "Conv1d"),
    (nn.Bilinear(8, 8, 100), "Bilinear")])
def test_a_large_layer_that_cannot_be_tiled_is_refused_by_name(module, what):
    with pytest.raises(TypeError, match=rf"model\.odd \({what}, .* not a plain nn.Embedding"):
        tiled(module, "model.odd", 100)


@pytest.fixture(scope="module")
def ranks(require_pycomm, tmp_path_factory):
    from _tiles_scenarios import run_all

    from pycomm.testing import run_ranks

    root = tmp_path_factory.mktemp("tiles")
    return run_ranks(run_all, 2, str(root), timeout_s=600.0), str(root)


def test_the_embedding_and_head_are_four_units_each(ranks):
    results, _root = ranks
    for result in results:
        assert sorted(result["tiled units"]).count(16 * 32) == 8  # 4 + 4 tiles of 16 rows
        assert 64 * 32 not in result["tiled units"] and 16 * 32 not in result["whole units"]


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from pycomm.parallel.checkpointing import dcp_chunks

    keys = [k for k in dcp_chunks.saved_keys(directory) if k.startswith(("model/", "optim."))]
    return dcp_chunks.read_whole(directory, keys)


def test_a_tiled_checkpoint_is_the_models_tensors_and_round_trips_a_layout_without(ranks):
    """Saved under the model's names and shapes; read by dp=2 ZeRO-3 without tiles (its
    logits equal the tiled engine's), saved, read by tiles again: every parameter and
    optimizer state tensor unchanged."""
    results, root = ranks
    tiled_state = _tensors(os.path.join(root, "tiled"))
    assert tiled_state["model/model.embed_tokens.weight"].shape == (64, 32)
    assert tiled_state["model/lm_head.weight"].shape == (64, 32)
    assert not [k for k in tiled_state if "tiles" in k]
    for name in ("whole", "tiled-again"):
        other = _tensors(os.path.join(root, name))
        assert other.keys() == tiled_state.keys()
        for key, value in tiled_state.items():
            assert torch.equal(other[key], value), (name, key)
    for result in results:
        torch.testing.assert_close(result["whole logits"], result["tiled logits"],
                                   rtol=0, atol=1e-6)


def test_the_export_of_a_tiled_run_loads_with_from_pretrained(ranks):
    """``from_pretrained`` on the export gives the tiled engine's logits; pretrained
    weights read into tiles built on the meta device give them too, each rank reading
    only its shards, and save back the same tensors."""
    import transformers

    results, root = ranks
    hf = transformers.LlamaForCausalLM.from_pretrained(os.path.join(root, "hf"))
    from _tiles_scenarios import TOKENS

    with torch.no_grad():
        want = hf(TOKENS).logits
    total = sum(p.numel() for p in hf.parameters())
    for result in results:
        torch.testing.assert_close(result["tiled logits"], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["pretrained logits"], want, rtol=0, atol=1e-5)
        assert result["read"] < total  # its ZeRO shards, not the model
    saved = _tensors(os.path.join(root, "from-meta"))
    for name, value in hf.state_dict().items():
        assert torch.equal(saved[f"model/{name}"], value), name


def test_tiles_built_on_the_meta_device_hold_the_one_process_weights(ranks):
    from _pretrained_scenarios import llama

    from pycomm.parallel.compose.materialize import materialize
    from pycomm.parallel.models.hf import hf_causal_lm_plan

    _results, root = ranks
    model = llama(False, "meta")
    materialize(model, seed=0, init=hf_causal_lm_plan(model).init)
    saved = _tensors(os.path.join(root, "fresh"))
    for name, value in model.state_dict().items():
        if f"model/{name}" in saved:
            assert torch.equal(saved[f"model/{name}"], value), name
    assert "model/model.embed_tokens.weight" in saved and "model/lm_head.weight" in saved


def test_what_tiles_cannot_run_with_is_refused_by_name(ranks):
    results, _root = ranks
    for tied, zero2, tp2 in (r["refused"] for r in results):
        assert "lm_head.weight is tied" in tied or "embed_tokens.weight is tied" in tied, tied
        assert "a tied layer cannot be split into tiles" in tied
        assert "max_unit_bytes bounds ZeRO-3's gathered units" in zero2 and "zero=2" in zero2
        assert "max_unit_bytes with tp=2" in tp2, tp2


def _wide_vocab(tmp_path, **flags):
    import json

    from _tiles_scenarios import WIDE_VOCAB

    from pycomm.parallel.job.config import TrainConfig

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(WIDE_VOCAB))
    return TrainConfig(model=f"hf:{path}", block_size=32, batch_size=4, dp=2, zero=3,
                       eval_every=0, **flags)


def test_the_planner_predicts_the_pool_tiles_leave(require_pycomm, tmp_path):
    """The gathered units' pool, predicted and measured (the trainer's engine, 2 steps):
    equal, and tiles of 0.2 MiB cut it from the 2 MB embedding's buffers to the blocks'."""
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    from _tiles_scenarios import pool_of

    from pycomm.parallel.planner.fit import layout_of
    from pycomm.parallel.planner.memory import job_of, predict
    from pycomm.parallel.planner.shapes import model_shape
    from pycomm.testing import run_ranks

    pools, losses = {}, {}
    for mb in (0.0, 0.2):
        cfg = _wide_vocab(tmp_path, max_unit_mb=mb)
        predicted = predict(model_shape(cfg), layout_of(cfg), job_of(cfg))[0]
        for result in run_ranks(pool_of, 2, cfg, timeout_s=300.0):
            assert result["pool_peak_reserved_bytes"] == predicted.buffers["zero3 pool"]
            pools[mb], losses[mb] = result["pool_peak_reserved_bytes"], result["loss"]
    assert pools[0.2] * 5 < pools[0.0]
    assert losses[0.2] == pytest.approx(losses[0.0], rel=1e-6)


def test_memory_gb_tiles_the_layers_larger_than_a_block_where_that_fits(tmp_path):
    """A limit between the tiled and the whole layout's predicted peaks: ``fit_memory``
    picks ``--max-unit-mb`` of a block's size; below the tiled peak it refuses, naming
    the tiles it tried."""
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    from pycomm.parallel.planner.fit import PREDICTION_MARGIN, fit_memory, layout_of, worst_rank
    from pycomm.parallel.planner.memory import GIB, job_of
    from pycomm.parallel.planner.shapes import model_shape

    cfg = _wide_vocab(tmp_path)
    shape = model_shape(cfg)
    whole = worst_rank(shape, layout_of(cfg), job_of(cfg)).peak
    chosen, mem = fit_memory(cfg, (whole - 1) / (1 - PREDICTION_MARGIN) / GIB)
    block = max(sum(p.numel for p in lay.params) for lay in shape.layers if lay.is_block)
    assert chosen.max_unit_mb * 2**20 == 4 * block and mem.peak < whole
    with pytest.raises(ValueError, match="with --max-unit-mb"):
        fit_memory(cfg, (mem.peak - 1) / (1 - PREDICTION_MARGIN) / GIB)
