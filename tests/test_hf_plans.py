"""Plans for HuggingFace causal LMs: every family of the installed transformers whose
config declares a pipeline plan either has a derived plan that computes the model's own
logits layer by layer (fp32, atol 1e-5), or is refused by name with what is missing. GPT-2's
hand-written plan reproduces it too, and a plan's tensor-parallel styles, applied over 2
ranks, give the one-process logits."""

from __future__ import annotations

import re

import pytest
import torch

from pycomm.parallel.compose.hf_check import check_plan_forward
from pycomm.parallel.compose.layers import sequential_forward
from pycomm.parallel.models.gpt2_plan import gpt2_plan
from pycomm.parallel.models.hf import DecoderCall, hf_causal_lm_plan
from pycomm.parallel.plans.plan import Layer
from pycomm.testing import RankPool
from tests import _hf_plan_scenarios as sc

# None of the imports above imports transformers: the plans import it when they run.
transformers = pytest.importorskip(
    "transformers", reason="no transformers (optional: pip install transformers)")

ATOL = 1e-5
# The families of transformers 5.24 whose config has base_model_pp_plan, tiny, by outcome.
REPRODUCED = [
    "apertus", "apertus1p5_text", "arcee", "codegen", "cwm", "ernie4_5", "exaone", "exaone4",
    "gemma", "gemma2", "gemma3_text", "gpt_neox", "gpt_oss", "gptj", "granite", "helium",
    "hyperclovax", "internlm3", "iquestcoder", "jais2", "llama", "ministral", "ministral3",
    "mistral", "olmo", "phi", "qwen2", "qwen3", "seed_oss", "smollm3", "starcoder2",
    "vaultgemma", "youtu",
    # mixtures of fused experts: the experts split by tp (moe_tp_experts) or by ep, the
    # router replicated (22 families were refused for their parameter-level tp entries)
    "afmoe", "axk1", "deepseek_v3", "dots1", "ernie4_5_moe", "exaone_moe", "flint",
    "glm4_moe", "hy_v3", "kolibri1", "laguna", "mellum", "mixtral", "qwen2_moe", "qwen3_moe",
    "sarvam_mla", "sarvam_moe", "solar_open",
    # a gathered fused projection the model slices itself, then rowwise_split_input
    "flex_olmo", "glm", "glm4", "minimax_m2", "minimax_m3_vl_text", "olmo2", "olmo3", "phi3",
    # logits or embeddings scaled outside the modules the pp plan names (hf_scales)
    "cohere", "cohere2", "cohere2_moe",
    # multi-head latent attention (mla_kv_a_proj; MiniCPM3's scaled head input too)
    "deepseek_v2", "glm4_moe_lite", "minicpm3",
]
FUSED_PARAM = "names a parameter of a fused module"  # a tp style on a tensor, not a module
REFUSED = {
    "beam": FUSED_PARAM, "mimo_v2_flash": FUSED_PARAM,
    "longcat_flash": FUSED_PARAM,  # its experts include identity ones (moe_identity_expert)
    "doge": "'embedding_rowwise' is not one this project implements",
    "aria_text": "'packed_rowwise' is not one this project implements",
    "axk2": "indexed_attention", "deepseek_v32": "indexed_attention",
    "glm_moe_dsa": "indexed_attention",
    "bailing_hybrid": "linear_attention", "kimi_linear": "linear_attention",
    "lara_mini": "linear_attention", "minimax": "linear_attention",
    "olmo_hybrid": "linear_attention", "qwen3_5_moe_text": "linear_attention",
    "qwen3_5_text": "linear_attention", "qwen3_next": "linear_attention",
    "deepseek_v4": "'hc_head'", "hy_v4": "'hc_head'", "granite_swa": "'rotary_embs'",
    # (phi4_multimodal, refused for 'embed_tokens_extend', takes 19 s to build)
    "hrm_text": "does not name modules", "inkling_text": "_tp_plan",
}
# Not covered: no tiny config builds without per-layer sub-configs or per-layer-type
# rope parameters: cohere_compass_text, dots3_note_text, gemma3n_text, gemma4_text,
# gemma4_unified_text.


def _build(model_type: str, **overrides):
    if sc.classes(model_type) is None:
        pytest.skip(f"no transformers model type {model_type!r} in transformers "
                    f"{transformers.__version__}")
    return sc.build(model_type, **overrides)


def _assert_reproduces(model, plan) -> None:
    with torch.no_grad():
        want = model(sc.TOKENS).logits
        got = sequential_forward(model, plan, sc.TOKENS)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert check_plan_forward(model, plan) <= ATOL


@pytest.mark.parametrize("model_type", REPRODUCED)
def test_derived_plan_reproduces_the_family(model_type):
    model = _build(model_type)
    _assert_reproduces(model, hf_causal_lm_plan(model))


@pytest.mark.parametrize(("model_type", "why"), sorted(REFUSED.items()))
def test_a_family_the_derivation_cannot_handle_is_refused(model_type, why):
    model = _build(model_type)
    pattern = rf"{type(model).__name__} cannot be derived: .*{re.escape(why)}.*plan="
    with pytest.raises(ValueError, match=pattern):
        hf_causal_lm_plan(model)


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),
    ("cohere", {"logit_scale": 0.25}), ("cohere2", {"logit_scale": 2.0}),
])
def test_families_scaling_outside_their_modules_are_reproduced(model_type, overrides):
    """Granite's embedding and logit multipliers and Cohere's logit scale, at values
    other than the tiny config's."""
    model = _build(model_type, **overrides)
    assert all(getattr(model.config, k) == v for k, v in overrides.items())
    _assert_reproduces(model, hf_causal_lm_plan(model))


def test_llama_with_eager_attention():
    model = _build("llama", attn_implementation="eager")
    _assert_reproduces(model, hf_causal_lm_plan(model))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_qwen2_with_sliding_window_layers(impl):
    """Layers 1 and 2 slide (window 4 over 8 tokens): each gets its own mask, and giving
    them the full causal mask instead is caught by check_plan_forward."""
    model = _build("qwen2", num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                   attn_implementation=impl)
    assert model.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    plan = hf_causal_lm_plan(model)
    _assert_reproduces(model, plan)
    plan.layers = [Layer(spec.modules, DecoderCall("full_attention", False))
                   if isinstance(spec, Layer) and isinstance(spec.call, DecoderCall) else spec
                   for spec in plan.layers]
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM .*eval mode.* differ by"):
        check_plan_forward(model, plan)


def test_mistral_slides_every_layer_without_layer_types():
    model = _build("mistral")
    plan = hf_causal_lm_plan(model)
    calls = [Layer.of(s).call for s in plan.layers]
    assert [c.layer_type for c in calls if isinstance(c, DecoderCall)] == ["sliding_attention"] * 2
    _assert_reproduces(model, plan)


def test_llama_plan():
    plan = hf_causal_lm_plan(_build("llama"))
    blocks = "model.layers.*"
    assert plan.blocks == blocks and plan.name == "LlamaForCausalLM"
    assert [Layer.of(s).modules for s in plan.layers] == [
        ("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",), ("model.norm",),
        ("lm_head",)]
    assert plan.tp == {
        **{f"{blocks}.self_attn.{p}_proj": "colwise" for p in "qkv"},
        f"{blocks}.self_attn.o_proj": "rowwise",
        f"{blocks}.mlp.gate_proj": "colwise", f"{blocks}.mlp.up_proj": "colwise",
        f"{blocks}.mlp.down_proj": "rowwise",
        "model.embed_tokens": "vocab_embedding", "lm_head": "vocab_head",
        f"{blocks}.self_attn": "per_rank_random"}
    assert plan.divisible == {"attention heads": 4, "key-value heads": 2}


@pytest.mark.parametrize("model_type", ["starcoder2", "gpt_oss", "codegen"])
def test_no_per_rank_random_where_attention_draws_on_whole_activations(model_type):
    """Starcoder2's and CodeGen's attention drop out their output (whole on every rank);
    GPT-OSS's tp plan does not split its attention at all."""
    plan = hf_causal_lm_plan(_build(model_type))
    assert "per_rank_random" not in plan.tp.values()


@pytest.mark.parametrize(("model_type", "overrides", "why"), [
    ("hyperclovax", {"embedding_multiplier": 2.0}, "embedding_multiplier = 2.0"),
    ("starcoder2", {"embedding_dropout": 0.1}, "embedding_dropout = 0.1"),
])
def test_a_forward_step_outside_the_layers_is_refused(model_type, overrides, why):
    model = _build(model_type, **overrides)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} cannot be derived: .*{why}"):
        hf_causal_lm_plan(model)


def test_gpt2_is_refused_by_the_derivation():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel cannot be derived: .*"
                                         r"base_model_tp_plan.*plan="):
        hf_causal_lm_plan(sc.gpt2())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gpt2_plan_reproduces_gpt2(impl):
    """Also in training mode (dropout 0.1 everywhere): the plan draws the model's masks."""
    model = sc.gpt2(attn_implementation=impl)
    _assert_reproduces(model, gpt2_plan(model))


def test_check_plan_forward_refuses_a_plan_that_skips_a_layer():
    model = _build("llama")
    plan = hf_causal_lm_plan(model)
    plan.layers = [s for s in plan.layers if Layer.of(s).modules != ("model.norm",)]
    with pytest.raises(ValueError, match=r"LlamaForCausalLM does not reproduce .*eval mode"
                                         r".*differ by up to \d"):
        check_plan_forward(model, plan)


def test_check_plan_forward_finds_a_dropout_the_plan_misses():
    model = sc.gpt2(embd_pdrop=0.5)
    plan = gpt2_plan(model)

    def no_dropout(modules, tokens, _context):
        wte, wpe, _drop = modules
        return wte(tokens) + wpe(torch.arange(tokens.shape[1]).unsqueeze(0))

    plan.layers[0] = Layer(Layer.of(plan.layers[0]).modules, no_dropout)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel .*training mode"):
        check_plan_forward(model, plan)


def test_check_plan_forward_leaves_no_trace():
    """The generator, every module's mode (mixed ones too) and the gradients are as
    before."""
    model = _build("llama").train()
    model.model.layers[1].eval()
    modes = [m.training for m in model.modules()]
    state = torch.get_rng_state()
    assert check_plan_forward(model, hf_causal_lm_plan(model)) <= ATOL
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", pg_timeout_s=60) as pool:
        yield pool


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3", "gpt_neox", "mistral", "gemma",
                                        "mixtral", "qwen3_moe", "qwen2_moe", "phi3", "olmo2",
                                        "deepseek_v2", "minicpm3"])
def test_tp_styles_of_the_plan_give_the_one_process_logits(pool2, model_type):
    """tp = 2 over the world group, styles applied by hand, logits gathered by the head."""
    if model_type != "gpt2":
        _build(model_type)  # skips where this transformers lacks the family
    for rank, diff in enumerate(pool2.run(sc.tp_difference, model_type, {})):
        assert diff <= ATOL, f"rank {rank}: logits differ by {diff:.3g}"
