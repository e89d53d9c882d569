"""Plans for HuggingFace causal LMs, read from the model's own tensor- and pipeline-parallel
plans, and the check that a plan computes what the model computes.

A HuggingFace config that declares ``base_model_pp_plan`` names the base model's forward
as modules in order (``embed_tokens``, the decoder ``layers``, ``norm``) and
``base_model_tp_plan`` its tensor-parallel styles; the ``*ForCausalLM`` class adds its
``lm_head`` (``_pp_plan``, ``_tp_plan``). :func:`hf_causal_lm_plan` turns them into a
:class:`~pycomm.parallel.plans.plan.Plan`: the embedding, one block per decoder layer, the final
norm and the head, with a context that computes, for the whole sequence, what the base
model's forward computes between them (position ids, the rotary table, the attention masks
by transformers' own ``masking_utils``). Whatever that forward does beyond this (an
embedding multiplier, a logit scale, a second rotary table, a module the pp plan does not
place) the plan would not do, so a family it cannot reproduce is refused by name, with
what is missing, as is a tp style this project does not implement (fused experts, MLA's
``mla_kv_a_proj``, ``rowwise_split_input``); ``plan=`` then takes a plan written for the
model (:mod:`pycomm.parallel.models.gpt2_plan` is one, worked through).

The attention gets ``per_rank_random`` (its dropout drawn per rank, on the rank's own
heads) only where the tp plan splits it by heads and every draw inside it falls on those
heads: an attention that drops out its own output (Starcoder2's ``residual_dropout``)
draws on activations every rank holds whole, which must stay alike.

Sequence parallelism: a Llama-style attention reshapes its projections by its *input's*
sequence length (``hidden_states.shape[:-1]``), so it must be given the whole sequence;
split along it, the heads come out scrambled. GPT-2's attention reads the projections'
own shapes and works on either.

:func:`pycomm.parallel.compose.hf_check.check_plan_forward` runs a plan and the model on one small
batch and refuses a plan whose logits differ: :func:`pycomm.parallel.compose.parallelize` calls it
for a model with real weights, so an adapter that does not reproduce a family is refused,
not trained wrong.

Example::

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")
    plan = hf_causal_lm_plan(model)
    check_plan_forward(model, plan)   # pycomm.parallel.compose.hf_check
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._optional import require
from ..moe.balance import RouterBalance
from ..plans.plan import MODEL_INPUTS, ContextRequest, Layer, Plan, matching
from ..tensor.styles import MlaKvAProj, style_of
from .hf_scales import ScaledSequence, applied_here, factor, scaled

# transformers' mask builders by layer type (``config.layer_types``).
MASKS = {"full_attention": "create_causal_mask",
         "sliding_attention": "create_sliding_window_causal_mask"}
# HuggingFace's styles for the LM head that our vocab-parallel head computes.
_HEAD_STYLES = (None, "colwise", "colwise_rep", "colwise_gather_output")
# Styles that leave a projection's output split across ranks (by heads, inside attention).
_HEAD_SPLIT = ("colwise", "packed_colwise")
# Steps some base models' or heads' forwards take outside the modules the pp plan names,
# with the values at which they do nothing. Families differ in what they mean (Granite
# divides by logits_scaling, HyperCLOVAX multiplies), so the plan does not guess.
_OUTSIDE_STEPS: dict[str, tuple[Any, ...]] = {
    "embedding_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "logit_scale": (None, 1, 1.0),
    "embedding_dropout": (None, 0, 0.0),
    "use_bidirectional_attention": (None, False),
}
# A dropout call inside an attention module's own forward (not the probability handed to
# the attention kernel): it would fall on whole (replicated) activations.
_DROPOUT_CALL = re.compile(r"dropout\s*\(")


def _refuse(model: nn.Module, what: str) -> ValueError:
    return ValueError(f"hf_causal_lm_plan: {type(model).__name__} cannot be derived: {what}; "
                      "pass plan= (a Plan written for this model, as "
                      "pycomm.parallel.models.gpt2_plan does for GPT-2)")


@dataclass(frozen=True)
class _Layout:
    """Where the base model's forward lives: the paths before the decoder layers, the
    decoder layers' list, and the paths after it."""

    before: tuple[str, ...]
    blocks: str
    after: tuple[str, ...]


def _base_model(model: nn.Module) -> tuple[str, nn.Module]:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        raise _refuse(model, f"no base model at base_model_prefix {prefix!r}")
    return prefix, base


def _layout(model: nn.Module, prefix: str, base: nn.Module) -> _Layout:
    """The pp plan's modules in order, split around the one ``ModuleList``.

    Raises:
        ValueError: no pp plan, not exactly one module list, or a module of the base model
            the pp plan does not place (its forward would do more than the plan).
    """
    pp = getattr(model.config, "base_model_pp_plan", None)
    if not pp:
        raise _refuse(model, "its config declares no base_model_pp_plan")
    names = list(pp)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
    if missing or len(lists) != 1:
        raise _refuse(model, f"base_model_pp_plan {names} does not name modules around one "
                      f"ModuleList of {type(base).__name__} (missing: {missing})")
    extra = [n for n, _ in base.named_children() if n not in pp and n != "rotary_emb"]
    extra += [n for n, _ in base.named_parameters(recurse=False)]
    if extra:
        raise _refuse(model, f"{type(base).__name__} has {extra}, which base_model_pp_plan "
                      "does not place")
    cut = names.index(lists[0])
    return _Layout(tuple(f"{prefix}.{n}" for n in names[:cut]), f"{prefix}.{lists[0]}",
                   tuple(f"{prefix}.{n}" for n in names[cut + 1:]))


def _check_head(model: nn.Module, prefix: str) -> None:
    """The causal LM around the base model is its ``lm_head`` and nothing else."""
    children = sorted(n for n, _ in model.named_children() if n not in (prefix, "lm_head"))
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or children:
        raise _refuse(model, f"expected the base model and lm_head only (also has {children})")
    # The class's own plans: an instance's merge the base model's in, under the prefix.
    cls = type(model)
    if "lm_head" not in (getattr(cls, "_pp_plan", None) or {}):
        raise _refuse(model, "its class declares no _pp_plan for lm_head")
    declared = dict(getattr(cls, "_tp_plan", None) or {})
    head_tp = dict(declared)
    style = head_tp.pop("lm_head", None)
    if style not in _HEAD_STYLES or head_tp:
        raise _refuse(model, f"its class's _tp_plan {declared} is not a colwise "
                      "lm_head alone (what the vocab-parallel head computes)")


def _check_outside_steps(model: nn.Module, base: nn.Module) -> None:
    """Refuses a family whose forward scales or drops out what the plan passes along."""
    for name, neutral in _OUTSIDE_STEPS.items():
        if name in applied_here(model):
            continue  # the plan applies it (hf_scales)
        for owner in (model.config, base):
            value = getattr(owner, name, None)
            if value not in neutral:
                raise _refuse(model, f"its forward applies {name} = {value!r} outside the "
                              "modules base_model_pp_plan names")


def layer_types(model: nn.Module, count: int) -> list[str]:
    """Each decoder layer's attention type (``config.layer_types``; without it, as
    Mistral's forward: sliding windows for all when ``config.sliding_window`` is set).

    Raises:
        ValueError: a layer type with no mask builder here (linear attention, chunks).
    """
    config = model.config
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * count
    types = list(types)[:count]
    unknown = sorted(set(types) - set(MASKS))
    if unknown or len(types) != count:
        raise _refuse(model, f"layer types {unknown or types} (known: {sorted(MASKS)})")
    return types


def accepted_kwargs(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``fn``'s signature names (transformers
    renamed them across versions: ``input_embeds``, ``past_key_values``, ``cache``)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in offered.items() if k in params}


def attention_mask(kind: str, config: Any, request: ContextRequest) -> Any:
    """The mask transformers builds for a layer of type ``kind`` over the whole sequence
    of ``request``, from its padding mask and position ids (packed documents) as the
    model's forward would (None where the kernel applies causality itself)."""
    masking_utils = require("transformers.masking_utils",
                            "pycomm.parallel.models.hf (HuggingFace models' attention masks)")
    fn = getattr(masking_utils, MASKS[kind])
    # Only the shape, dtype and device are read: a stride-0 view allocates nothing.
    embeds = torch.zeros((), dtype=request.dtype, device=request.device).expand(
        request.batch, request.seq, int(getattr(config, "hidden_size", 1)))
    cache_positions = torch.arange(request.seq, device=request.device)
    offered = {"config": config, "inputs_embeds": embeds, "input_embeds": embeds,
               "attention_mask": request.attention_mask(), "cache": None,
               "past_key_values": None, "position_ids": request.position_ids(),
               "cache_position": cache_positions}
    return fn(**accepted_kwargs(fn, offered))


@dataclass
class _Context:
    """The base model's per-forward values, for the whole sequence: position ids, the
    rotary table (one per layer type where the rotary module takes a layer type), and
    each layer type's mask. Holds the rotary module and the config only, not the base
    model, so that a pipeline stage does not keep every layer alive."""

    config: Any
    rotary: nn.Module | None
    types: tuple[str, ...]

    def __call__(self, request: ContextRequest) -> dict[str, Any]:
        positions = request.position_ids()
        masks = {t: attention_mask(t, self.config, request) for t in set(self.types)}
        out = {"position_ids": positions, "attention_mask": masks}
        if self.rotary is not None:
            x = torch.zeros((), dtype=request.dtype, device=request.device).expand(
                request.batch, request.seq, int(getattr(self.config, "hidden_size", 1)))
            if "layer_type" in inspect.signature(self.rotary.forward).parameters:
                out["position_embeddings"] = {t: self.rotary(x, positions, t)
                                              for t in set(self.types)}
            else:
                out["position_embeddings"] = self.rotary(x, positions)
        return out


@dataclass(frozen=True)
class DecoderCall:
    """A decoder layer called as the base model's forward calls it: with its layer type's
    mask (and rotary table), the position ids, and no cache. Older transformers return a
    tuple: its first element is the hidden states."""

    layer_type: str
    rope_per_type: bool

    def __call__(self, modules: Sequence[nn.Module], x: Any, context: dict[str, Any]) -> Any:
        kwargs = {"attention_mask": context["attention_mask"][self.layer_type],
                  "position_ids": context["position_ids"]}
        rope = context.get("position_embeddings")
        if rope is not None:
            kwargs["position_embeddings"] = rope[self.layer_type] if self.rope_per_type else rope
        out = modules[0](x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class HeadCall:
    """The LM head, with the final logit soft-capping (``c * tanh(logits / c)``) of the
    families that declare ``final_logit_softcapping``: elementwise, so it is the same on
    vocab-split logits."""

    softcap: float | None

    def __call__(self, modules: Sequence[nn.Module], x: Any, _context: dict[str, Any]) -> Any:
        logits = modules[0](x)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a HuggingFace output (``.logits``) or from the head layer (a tensor)."""
    return output.logits if hasattr(output, "logits") else output


def _checked_style(model: nn.Module, path: str, style: Any) -> Any:
    """``style`` for the modules ``path`` names; None where it names none of this
    model's (an entry for layers this config does not build: Qwen3-MoE's dense MLPs).

    Raises:
        ValueError: a style this project does not implement, or one on a parameter of a
            fused module (which a module style would leave whole).
    """
    try:
        style_of(style, path)
    except ValueError as err:
        raise _refuse(model, str(err)) from err
    if matching(path, model):
        return style
    parent, _, leaf = path.rpartition(".")
    if any(isinstance(getattr(model.get_submodule(p), leaf, None), nn.Parameter)
           for p in matching(parent, model)):
        raise _refuse(model, f"base_model_tp_plan entry {path!r} (style {style!r}) names a "
                      "parameter of a fused module, not a module")
    return None


def _attention_patterns(tp: dict[str, Any], blocks: str) -> list[str]:
    """The attention modules whose projections the tp plan splits by heads: the parents
    of its colwise entries named like an attention (``self_attn``, ``attention``)."""
    parents = {p.rpartition(".")[0] for p, s in tp.items() if s in _HEAD_SPLIT}
    return sorted(p for p in parents if p.startswith(blocks + ".*.")
                  and re.search(r"attn|attention", p.rpartition(".")[2]))


def _draws_per_head(attn: nn.Module) -> bool:
    """Whether every random draw inside ``attn`` falls on this rank's heads: no dropout
    module in it and no dropout call in its own forward (only the probability it hands
    to the attention kernel)."""
    if any(isinstance(m, nn.Dropout) for m in attn.modules()):
        return False
    try:
        source = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        return False
    return not _DROPOUT_CALL.search(source)


def _per_rank_random(model: nn.Module, tp: dict[str, Any], blocks: str) -> dict[str, str]:
    """``per_rank_random`` for each attention split by heads whose draws all fall on the
    rank's heads (on whole activations they must be alike on every rank)."""
    out = {}
    for pattern in _attention_patterns(tp, blocks):
        found = matching(pattern, model)
        if found and all(_draws_per_head(model.get_submodule(p)) for p in found):
            out[pattern] = "per_rank_random"
    return out


# The fused experts' tensors as TPExperts splits them: gate_up_proj (E, 2I, H) by its
# packed output rows, down_proj (E, H, I) by its input columns.
_EXPERT_TENSOR_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def _expert_entries(declared: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The fused experts' entries (``X.experts``: ``moe_tp_experts``, and its parameters'
    ``X.experts.gate_up_proj`` / ``down_proj``, which that style splits) as one module
    style, the router beside them (``X.gate``) replicated; and the entries they replace."""
    styles: dict[str, Any] = {}
    taken: set[str] = set()
    for pattern, style in declared.items():
        if style != "moe_tp_experts":
            continue
        params = [p for p in declared if p.rpartition(".")[0] == pattern]
        if {p.rpartition(".")[2]: declared[p] for p in params} != _EXPERT_TENSOR_STYLES:
            continue  # another layout of the tensors: its styles are checked one by one
        styles[pattern] = "moe_tp_experts"
        styles[f"{pattern.rpartition('.')[0]}.gate"] = "replicated"
        taken |= {pattern, *params}
    return styles, taken


def _tp(model: nn.Module, prefix: str, layout: _Layout) -> dict[str, Any]:
    """The config's styles under the base model's prefix; the embedding and the head
    vocab-parallel (the head's logits split for the vocab-parallel loss); fused experts
    split by their intermediate units, the router replicated."""
    embed = layout.before[0]
    tp: dict[str, Any] = {}
    declared = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    experts, taken = _expert_entries(declared)
    entries = {**experts, **{p: s for p, s in declared.items() if p not in taken}}
    for pattern, style in entries.items():
        path = f"{prefix}.{pattern}"
        if style == "mla_kv_a_proj":
            config: Any = model.config
            style = MlaKvAProj(int(config.qk_rope_head_dim))
            tp.update(_mla_down_projections(model, path))
        # HF's embedding split (rowwise) gives way to the vocab split
        if path != embed and (checked := _checked_style(model, path, style)) is not None:
            tp[path] = checked
    tp[embed] = "vocab_embedding"
    tp["lm_head"] = "vocab_head"
    return {**tp, **_beside_whole(model, tp), **_per_rank_random(model, tp, layout.blocks)}


# Multi-head latent attention's down-projections and their norms: whole, on whole
# activations, each feeding a column-split projection (whose backward sums their
# gradient over the ranks).
_MLA_DOWN = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")


def _mla_down_projections(model: nn.Module, kv_a_path: str) -> dict[str, Any]:
    attention = kv_a_path.rpartition(".")[0]
    module = model.get_submodule(attention.replace("*", "0"))
    return {f"{attention}.{name}": "replicated" for name in _MLA_DOWN
            if isinstance(getattr(module, name, None), nn.Module)}


# Styles after which a module's activations are whole on every rank: a gathered column
# split, and a row split that takes its part of a whole input itself.
_WHOLE = ("colwise_gather_output", "colwise_rep", "rowwise_split_input")


def _beside_whole(model: nn.Module, tp: dict[str, Any]) -> dict[str, Any]:
    """``replicated`` for the unstyled modules with weights beside split projections
    whose activations are all whole (OLMo-2's q_norm and k_norm, over the gathered
    Q and K): each rank computes them on the same values, as one process does."""
    parents: dict[str, set[Any]] = {}
    for pattern, style in tp.items():
        parents.setdefault(pattern.rpartition(".")[0], set()).add(style)
    out: dict[str, Any] = {}
    for parent, styles in parents.items():
        if not parent or not styles <= set(_WHOLE):
            continue
        try:
            module = model.get_submodule(parent.replace("*", "0"))
        except AttributeError:
            continue
        for name, child in module.named_children():
            pattern = f"{parent}.{name}"
            if pattern not in tp and any(True for _ in child.parameters(recurse=False)):
                out[pattern] = "replicated"
    return out


def _experts(model: nn.Module, prefix: str) -> str | None:
    """The pattern of the fused experts modules (``moe_tp_experts`` in the tp plan)."""
    declared = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    found = [f"{prefix}.{p}" for p, s in declared.items() if s == "moe_tp_experts"]
    return found[0] if len(found) == 1 and matching(found[0], model) else None


def _router_balance(model: nn.Module, prefix: str) -> RouterBalance | None:
    """The routers beside the fused experts and the load-balancing loss that the model's
    forward adds to its loss (only with ``output_router_logits``, as transformers does)."""
    config: Any = model.config
    coef = getattr(config, "router_aux_loss_coef", None)
    if not coef or not getattr(config, "output_router_logits", False):
        return None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    declared = dict(getattr(config, "base_model_tp_plan", None) or {})
    routers = [f"{prefix}.{p.rpartition('.')[0]}.gate" for p, s in declared.items()
               if s == "moe_tp_experts"]
    routers = [r for r in routers if matching(r, model)]
    if not (experts and top_k and len(routers) == 1):
        raise _refuse(model, f"its forward adds a load-balancing loss (router_aux_loss_coef "
                      f"{coef}) whose routers and experts are not found (routers {routers}, "
                      f"experts {experts}, top-k {top_k})")
    return RouterBalance(routers[0], int(experts), int(top_k), float(coef))


def _divisible(config: Any) -> dict[str, int]:
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return {k: int(v) for k, v in (("attention heads", heads), ("key-value heads", kv)) if v}


def hf_causal_lm_plan(model: nn.Module) -> Plan:
    """The plan of a HuggingFace ``*ForCausalLM`` from its config's ``base_model_tp_plan``
    and ``base_model_pp_plan`` and its class's ``_tp_plan`` / ``_pp_plan``.

    Args:
        model: e.g. a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``.

    Raises:
        ValueError: naming the class and what is missing, for a family this cannot derive
            (no pp or tp plan, a layout or forward step it does not reproduce, a style
            this project does not implement); pass ``plan=`` for it.
    """
    config: Any = model.config
    if not getattr(config, "base_model_tp_plan", None):
        raise _refuse(model, "its config declares no base_model_tp_plan")
    _check_transformers(model)
    prefix, base = _base_model(model)
    layout = _layout(model, prefix, base)
    _check_head(model, prefix)
    _check_outside_steps(model, base)
    blocks: Any = model.get_submodule(layout.blocks)
    types = layer_types(model, len(blocks))
    rotary = getattr(base, "rotary_emb", None)
    per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    decoders = [Layer((f"{layout.blocks}.{i}",), DecoderCall(t, per_type))
                for i, t in enumerate(types)]
    head = Layer(("lm_head",), scaled(
        HeadCall(getattr(config, "final_logit_softcapping", None)), factor(model, "logits")))
    embed_by = factor(model, "embed")
    before = Layer(layout.before, ScaledSequence(embed_by) if embed_by is not None else None)
    return Plan(layers=[before, *decoders, Layer(layout.after), head],
                blocks=f"{layout.blocks}.*", tp=_tp(model, prefix, layout),
                context=_Context(config, rotary, tuple(types)), output=logits_of,
                divisible=_divisible(config), init=hf_init(model), inputs=MODEL_INPUTS,
                experts=_experts(model, prefix), balance=_router_balance(model, prefix),
                name=type(model).__name__)


def hf_init(model: nn.Module) -> Callable[[str, nn.Module], None]:
    """A module's weights as its model's ``_init_weights`` gives them (for a model built on
    the meta device: each module initialised on its own, rotary tables included)."""
    init: Any = getattr(model, "_init_weights")  # noqa: B009 (every PreTrainedModel has it)

    def init_module(_path: str, module: nn.Module) -> None:
        init(module)

    return init_module


def _check_transformers(model: nn.Module) -> None:
    """transformers has the mask builders the context calls (4.53 and later)."""
    require("transformers", "pycomm.parallel.models.hf (HuggingFace models)")
    try:
        from transformers import masking_utils
    except ImportError as err:
        raise _refuse(model, f"transformers has no masking_utils ({err})") from err
    if not all(hasattr(masking_utils, fn) for fn in MASKS.values()):
        raise _refuse(model, f"transformers.masking_utils lacks one of {sorted(MASKS.values())}")
