"""``--memory-gb`` without ``--plan auto`` (pycomm.parallel.planner.fit): the layout given is kept
where it fits, refused before any rank starts with its predicted peak where it does
not, and with ZeRO-3 offload its read-ahead and live budget are picked to fit; the
planner's mixed-precision stage 3 and HuggingFace configs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pycomm.parallel.job.config import TrainConfig
from pycomm.parallel.planner.fit import PREDICTION_MARGIN, fit_memory, layout_of, usable
from pycomm.parallel.planner.fit import worst_rank as worst_of
from pycomm.parallel.planner.memory import Memory, job_of
from pycomm.parallel.planner.planner import GIB, evaluate
from pycomm.parallel.planner.shapes import model_shape

# a GPT whose gathered-unit pool and records are most of what an offloaded rank holds
OFFLOADED = TrainConfig(n_layer=6, n_head=4, n_embd=256, block_size=32, batch_size=4,
                        dp=2, zero=3, offload="disk", offload_dir="/tmp", offload_prefetch=2,
                        max_grad_norm=1.0, eval_every=0)


def worst_rank(cfg: TrainConfig) -> Memory:
    return worst_of(model_shape(cfg), layout_of(cfg), job_of(cfg))


def _peak(cfg: TrainConfig) -> int:
    return worst_rank(cfg).peak


def limit_for(peak: int) -> float:
    """The ``--memory-gb`` whose usable part (the prediction's margin kept) is ``peak``."""
    return peak / (1 - PREDICTION_MARGIN) / GIB


def test_a_prediction_keeps_its_margin_free():
    """Predicted 5% under a limit: refused (10% is kept for the prediction's error)."""
    peak = _peak(dataclasses.replace(OFFLOADED, offload="none"))
    with pytest.raises(ValueError, match=r"less 10% for the prediction's error"):
        fit_memory(dataclasses.replace(OFFLOADED, offload="none"), peak * 1.05 / GIB)


def test_a_layout_that_fits_is_kept_as_given():
    limit = limit_for(_peak(OFFLOADED)) * 1.01
    chosen, mem = fit_memory(OFFLOADED, limit)
    assert chosen == OFFLOADED and mem.peak <= usable(int(limit * GIB))


def test_offload_reads_ahead_less_then_budgets_the_pool_to_fit():
    """Each limit below the given settings' peak is met by the deepest read-ahead that
    fits, then the largest live budget; the prediction of what was chosen fits."""
    full = _peak(OFFLOADED)
    shallow = _peak(dataclasses.replace(OFFLOADED, offload_prefetch=0))
    assert shallow < full
    chosen, mem = fit_memory(OFFLOADED, limit_for(full - 1))
    assert chosen.offload_prefetch < 2 or chosen.max_live_mb > 0
    assert mem.peak <= full - 1 and mem.peak == _peak(chosen)
    tight, mem = fit_memory(OFFLOADED, limit_for(shallow - 1))  # only a budget helps now
    assert tight.offload_prefetch == 0 and tight.max_live_mb > 0
    assert mem.peak <= shallow - 1 and mem.peak == _peak(tight)


def test_a_layout_that_cannot_fit_is_refused_with_its_predicted_peak():
    with pytest.raises(ValueError) as err:
        fit_memory(OFFLOADED, 0.001)
    message = str(err.value)
    assert "dp2 tp1 pp1 zero3 offload=disk is predicted to need" in message
    assert "more than --memory-gb 0.001" in message
    for term in ("zero3 pool", "offload records", "activations"):
        assert term in message
    with pytest.raises(ValueError, match=r"zero3 is predicted to need .* optimizer state"):
        fit_memory(dataclasses.replace(OFFLOADED, offload="none"), 0.001)


def test_mixed_precision_is_predicted_at_zero3_only():
    bf16 = dataclasses.replace(OFFLOADED, offload="none", precision="bf16")
    fp32 = dataclasses.replace(OFFLOADED, offload="none")
    low, high = worst_rank(bf16), worst_rank(fp32)
    # the gathered parameters in bf16 (their gradients reduce in fp32), activations too
    assert low.buffers["zero3 pool"] < high.buffers["zero3 pool"]
    assert low.activations < high.activations
    assert low.buffers["zero3 compute-dtype shards"] > 0
    with pytest.raises(ValueError, match="precision bf16 is modelled at --zero 3 only"):
        fit_memory(dataclasses.replace(bf16, zero=2), 1.0)


def test_the_trainer_refuses_before_any_rank_starts(capsys):
    from pycomm.parallel.train import main

    assert main(["--dp", "2", "--zero", "3", "--memory-gb", "0.0001", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "is predicted to need" in err and "more than --memory-gb 0.0001" in err


def test_huggingface_configs_are_planned(tmp_path):
    pytest.importorskip("transformers", reason="no transformers (the [hf] extra)")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 64, "tie_word_embeddings": False}
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(config))
    cfg = TrainConfig(model=f"hf:{path}", block_size=16, batch_size=2, eval_every=0)
    shape = model_shape(cfg)
    assert (shape.kind, shape.hidden, shape.ffn, shape.vocab, shape.n_layer) == (
        "llama", 64, 176, 1000, 2)
    assert shape.total_params == 2 * 1000 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176
                                                      + 2 * 64) + 64
    config.update(model_type="opt", architectures=["OPTForCausalLM"], ffn_dim=128,
                  word_embed_proj_dim=64)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'opt' is not modelled"):
        model_shape(cfg)


def test_offload_to_host_memory_counts_the_store():
    """offload=cpu keeps every record in host memory: on this machine it saves nothing,
    and the prediction says so (the store is master, state and gradient per element)."""
    disk = worst_rank(OFFLOADED)
    host = dataclasses.replace(OFFLOADED, offload="cpu")
    mem = worst_rank(host)
    assert mem.buffers["offload host store"] == mem.offloaded * 16
    assert mem.peak == disk.peak + mem.buffers["offload host store"]


def test_the_planner_fits_offloaded_layouts_with_the_settings_that_fit():
    """Its table (and --plan auto) predicts an offloaded ZeRO-3 layout with the
    read-ahead and budget that fit the memory given, and lists them."""
    full = _peak(OFFLOADED)
    rows, _ = evaluate(OFFLOADED, 2, limit_for(full - 1), offloads=("disk",))
    row = next(r for r in rows if str(r.layout) == "dp2 tp1 pp1 zero3 offload=disk")
    assert row.fits and row.peak <= full - 1 and row.settings
    assert str(row).startswith("dp2 tp1 pp1 zero3 offload=disk (")
    chosen = dataclasses.replace(OFFLOADED, **row.settings)
    assert _peak(chosen) == row.peak


@pytest.mark.usefixtures("require_pycomm")
def test_under_torchrun_every_rank_raises_what_rank_0_found():
    """Rank 0 plans; a layout that does not fit is raised on every rank, none left
    waiting for the broadcast of a layout."""
    from pycomm.testing import run_ranks
    from tests import _plan_predictor_scenarios as sc

    cfg = dataclasses.replace(OFFLOADED, memory_gb=0.0001)
    for message in run_ranks(sc.refused_everywhere, 2, cfg, timeout_s=120.0):
        assert "is predicted to need" in message and "--memory-gb 0.0001" in message
