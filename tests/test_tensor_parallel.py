"""pycomm.parallel.tensor at TP = 2, 3 and 4 (one spawn each), on pycomm and gloo groups,
against the unsharded model built from the same weights."""

import pytest
import torch
from _tp_scenarios import CFG, ROWS, reference, run_all

GROUPS = ["pycomm", "gloo"]
SP = [False, True]


@pytest.fixture(scope="module")
def single():
    return reference()


@pytest.fixture(scope="module", params=[2, 3, 4])
def tp(request, require_pycomm):
    from pycomm.testing import run_ranks

    return request.param, run_ranks(run_all, request.param, request.param, timeout_s=600.0)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("sp", SP)
def test_forward_loss_and_every_gradient_match_the_unsharded_model(tp, single, group, sp):
    _, ranks = tp
    for r in ranks:
        run = r[(group, sp, "numerics")]
        torch.testing.assert_close(run["logits"], single["logits"], rtol=1e-5, atol=1e-6)
        assert run["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert run["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("sp", SP)
def test_ten_sgd_steps_give_the_same_parameters(tp, single, group, sp):
    _, ranks = tp
    run = ranks[0][(group, sp, "numerics")]
    for name, value in single["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gathered_state_dict_is_the_unsharded_one(tp):
    from _tp_scenarios import model

    _, ranks = tp
    dense = model().state_dict()
    initial = ranks[0][("pycomm", False, "numerics")]["initial"]
    assert initial.keys() == dense.keys()
    for name, value in dense.items():
        assert torch.equal(initial[name], value), name


def test_sharded_layers_hold_one_tp_th_of_the_parameters(tp):
    size, ranks = tp
    local = ranks[0][("pycomm", False, "numerics")]["local_param_numel"]
    from _tp_scenarios import model

    dense = dict(model().named_parameters())
    for name in ("blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_fc.weight",
                 "blocks.0.mlp.c_proj.weight", "embed.wte.weight", "lm_head.weight"):
        assert local[name] * size == dense[name].numel(), name
    assert local["blocks.0.ln_1.weight"] == dense["blocks.0.ln_1.weight"].numel()


def test_two_all_reduces_per_layer_each_way_without_sequence_parallelism(tp):
    _, ranks = tp
    for r in ranks:
        blocks = r[(False, "blocks")]
        for name in ("attn", "mlp"):  # f and g: one all-reduce in each direction each
            assert blocks[name] == {"all_reduce:forward": 1, "all_reduce:backward": 1}, blocks
        counts = r[("pycomm", False, "numerics")]["counts"]
        layers = CFG.n_layer
        # + the vocab-parallel embedding (1) and cross-entropy (3); backward + the head's f
        assert counts == {"all_reduce:forward": 2 * layers + 4,
                          "all_reduce:backward": 2 * layers + 1}, counts


def test_sequence_parallelism_trades_all_reduces_for_gathers_and_scatters(tp):
    _, ranks = tp
    for r in ranks:
        blocks = r[(True, "blocks")]
        for name in ("attn", "mlp"):
            # forward: the region gathers the sequence at its input, the row-parallel
            # layer reduce-scatters after; backward: the conjugates plus the gather
            # again (the column-parallel layer kept only this rank's part), and the
            # row-parallel bias's partial gradient summed as it arrives
            assert blocks[name] == {"all_gather:forward": 1, "reduce_scatter:forward": 1,
                                    "all_gather:backward": 2, "reduce_scatter:backward": 1,
                                    "all_reduce:backward": 1}
        counts = r[("pycomm", True, "numerics")]["counts"]
        layers = CFG.n_layer
        assert counts["all_gather:forward"] == 2 * layers + 1  # + the last block's output
        assert counts["reduce_scatter:forward"] == 2 * layers
        # only outside the blocks: the embedding (1) and the loss (3) forward; backward
        # the head's f (its input is whole again) and one all-reduce per partial gradient
        # as it arrives (per block two norms of two parameters and two row biases), so
        # that a ZeRO stage that packs and drops gradients still gets whole ones
        assert counts["all_reduce:forward"] == 4
        assert counts["all_reduce:backward"] == 6 * layers + 1


def test_recomputing_the_gathered_input_saves_its_memory(tp):
    """Each split region's column-parallel layer (2 per block) keeps its 1/TP input
    instead of the gathered one: (TP - 1) / TP of a (rows, time, hidden) fp32 tensor.
    (The head's input is whole: the last block gathered it.)"""
    size, ranks = tp
    saved = ranks[0]["saved"]
    per_input = ROWS * CFG.block_size * CFG.n_embd * 4
    expected = 2 * CFG.n_layer * per_input * (size - 1) // size
    assert saved[False] - saved[True] == expected, saved


def test_column_then_row_with_gathered_output_and_split_input(tp):
    _, ranks = tp
    pair = ranks[0]["pair"]
    torch.testing.assert_close(pair["out"], pair["dense_out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pair["grad"], pair["dense_grad"], rtol=1e-5, atol=1e-6)


def test_dropout_streams_match_where_they_must_and_differ_where_they_must(tp):
    _, ranks = tp
    first = ranks[0]["rng"]
    for r in ranks[1:]:
        assert torch.equal(r["rng"]["draws"]["replicated"], first["draws"]["replicated"])
        assert not torch.equal(r["rng"]["draws"]["tensor-parallel"],
                               first["draws"]["tensor-parallel"])
        # with dropout 0.2 everywhere (attention: each rank its own heads' masks),
        # activations that are whole on every rank stayed identical
        assert torch.equal(r["rng"]["hidden"], first["hidden"])
    for r in ranks:
        assert not torch.allclose(r["rng"]["hidden"], r["rng"]["hidden_eval"]), "no dropout?"
        assert r["rng"]["replay_equal"], "recomputation must draw the forward's masks"


def test_bad_input_gets_clear_errors(tp):
    size, ranks = tp
    bad = ranks[0]["bad"]
    assert f"GPT has attention heads = 5, not divisible by tp = {size}" in bad["heads"]
    assert "VocabParallelEmbedding num_embeddings: 97 is not divisible" in bad["vocab"]
    assert "(2, 7, 48) is not divisible by the tensor-parallel size" in bad["sequence"]
    assert "Linear has no tensor-parallel plan" in bad["not_gpt"]
    assert "model_parallel_seed" in bad["unseeded"]


@pytest.mark.parametrize("tp", [2], indirect=True)  # Llama's 2 key-value heads split by 2
def test_the_same_conversion_on_a_tied_gpt_and_llama_on_real_batches(tp):
    """One way for every model: the plan's styles, ties kept one parameter; the loss and
    the gradient norm of one process built from the same weights."""
    _, ranks = tp
    for r in ranks:
        cases = r["other_models"]
        assert len(cases) == 2 * (3 + 2)
        for key, run in cases.items():
            (loss, norm), (tp_loss, tp_norm) = run["single"], run["tp"]
            assert tp_loss == pytest.approx(loss, rel=1e-5), key
            assert tp_norm == pytest.approx(norm, rel=1e-5), key
            assert run["tied"] or key[0] != "gpt_tied", f"{key}: the tie was broken"
