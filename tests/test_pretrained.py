"""``engine.load_pretrained``: HuggingFace safetensors into the sharded engine, each rank
reading only its pieces, in layouts that split the model every way; the logits equal the
saved model's (``tests/_pretrained_scenarios.py``)."""

from __future__ import annotations

import pytest

from pycomm.testing import RankFailure, RankPool
from tests import _pretrained_scenarios as sc

pytestmark = pytest.mark.usefixtures("require_pycomm")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_each_rank_reads_its_pieces_and_the_model_is_the_saved_one(tmp_path, tied):
    want = sc.save(tied, str(tmp_path))
    with RankPool(2, backend="pycomm", pg_timeout_s=120) as pool:
        for layout in ("dp2 zero3", "tp2", "pp2 M=2"):
            for rank, (logits, read, total) in enumerate(pool.run(sc.load, layout, tied,
                                                                  str(tmp_path))):
                assert float((logits - want).abs().max()) < 1e-5, (layout, rank)
                assert 0 < read < total, (layout, rank, read, total)  # its pieces only


def test_a_missing_or_misshapen_tensor_is_refused_by_name(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    sc.save(False, str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with RankPool(2, backend="pycomm", pg_timeout_s=120) as pool, \
            pytest.raises(RankFailure, match=r"no model\.norm\.weight"):
        pool.run(sc.load, "dp2", False, str(tmp_path))
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with RankPool(2, backend="pycomm", pg_timeout_s=120) as pool, \
            pytest.raises(RankFailure, match=r"model\.norm\.weight has shape \(7,\)"):
        pool.run(sc.load, "dp2", False, str(tmp_path))


def test_the_trainer_starts_from_pretrained_weights(tmp_path):
    """``--from-pretrained``: the folder's model, its weights read into a tp2 layout (lr
    0: the exported model is the loaded one, every tensor bit for bit)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from tests.test_train import train

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "in")
    done = train("--from-pretrained", tmp_path / "in", "--tp", 2, "--steps", 1, "--lr", 0,
                 "--eval-every", 0, "--block-size", 32, "--batch-size", 4, "--no-progress",
                 "--export-hf", tmp_path / "out")
    assert "LlamaForCausalLM (pretrained" in done.stdout + done.stderr
    saved = load_file(str(tmp_path / "in" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(saved) == sorted(exported)
    for name, value in saved.items():
        assert torch.equal(exported[name], value), name
