"""A model's parameters as the planner sees them: each layer's parameters, which of them
tensor parallelism splits, and how a pipeline cuts the layers (the plan's own rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compose.layers import stage_balance
from ..plans.plan import Plan, ResolvedLayer, matching, under_any
from ..tensor.from_plan import check_divisible
from ..tensor.styles import Colwise, Rowwise, VocabEmbedding, VocabHead

VOCAB = 256  # the trainer's models are byte-level


@dataclass(frozen=True)
class Param:
    """One parameter: ``key`` names it once (a tie is one key in two layers)."""

    key: str
    numel: int
    tp_split: bool  # divided over the tensor-parallel ranks
    expert: bool = False  # a fused experts tensor: split over ep (over tp where ep = 1)
    rows: int = 0  # its first dimension (ZeRO-3 tiles split by rows; 0: one row)


@dataclass(frozen=True)
class LayerShape:
    """One layer of the plan (a block, or the embedding, the final norm, the head)."""

    name: str
    params: tuple[Param, ...]
    is_block: bool


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its layers and the sizes of its activations.

    ``heads`` and ``hidden`` are the attention heads and width, ``ffn`` the MLP's inner
    width, ``seq`` the sequence length, ``vocab`` the vocabulary.
    """

    kind: str
    layers: tuple[LayerShape, ...]
    heads: int
    hidden: int
    ffn: int
    seq: int
    vocab: int
    divisible: tuple[tuple[str, int], ...]
    top_k: int = 0  # experts per token (a mixture of experts)

    @property
    def n_layer(self) -> int:
        return sum(layer.is_block for layer in self.layers)

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in _unique(list(self.layers)))

    def check_tp(self, tp: int) -> None:
        """Raises ValueError unless ``tp`` divides what the plan says it must (heads)."""
        check_divisible(Plan(divisible=dict(self.divisible), name=self.kind), tp)

    def balance(self, pp: int) -> list[int]:
        """Layers per pipeline stage, as the engine cuts them (raises ValueError where it
        would refuse: fewer blocks than stages)."""
        resolved = [ResolvedLayer(i, (layer.name,), None, layer.is_block)
                    for i, layer in enumerate(self.layers)]
        return stage_balance(resolved, pp, self.kind)

    def stage_layers(self, pp: int, stage: int) -> list[LayerShape]:
        balance = self.balance(pp)
        first = sum(balance[:stage])
        return list(self.layers[first : first + balance[stage]])

    @property
    def has_experts(self) -> bool:
        return any(p.expert for layer in self.layers for p in layer.params)

    def stage_params(self, pp: int, stage: int, tp: int, ep: int = 1) -> list[int]:
        """Elements of each parameter one rank of ``stage`` holds (its TP part) that the
        data side treats as dense: all of them at ep = 1, the experts tensors apart at
        ep > 1 (:meth:`stage_experts`)."""
        return [p.numel // tp if p.tp_split else p.numel
                for p in _unique(self.stage_layers(pp, stage)) if not (p.expert and ep > 1)]

    def stage_experts(self, pp: int, stage: int, ep: int) -> list[int]:
        """Elements of each experts tensor one rank of ``stage`` holds at ep > 1: ``E /
        ep`` of the experts, whole on every tensor-parallel rank (none at ep = 1)."""
        return [p.numel // ep for p in _unique(self.stage_layers(pp, stage))
                if p.expert and ep > 1]


def _unique(layers: list[LayerShape]) -> list[Param]:
    seen: dict[str, Param] = {}
    for layer in layers:
        for p in layer.params:
            seen.setdefault(p.key, p)
    return list(seen.values())


_SPLIT_ALL = (Colwise, VocabEmbedding, VocabHead)  # weight and bias split


def _split(styles: list[Any], param_name: str) -> bool:
    if any(isinstance(s, _SPLIT_ALL) for s in styles):
        return True
    # row parallel: the weight's input features are split, the bias is added once, whole
    return any(isinstance(s, Rowwise) for s in styles) and param_name != "bias"


def from_model(model: Any, plan: Plan, kind: str, cfg: Any,
               dims: tuple[int, int, int, int] | None = None) -> ModelShape:
    """The shape of ``model`` (built on the meta device) under ``plan``: the layers the
    plan resolves, each parameter split where the plan's style splits its module.
    ``dims``: (heads, hidden, MLP width, vocabulary), by default the trainer's GPT's."""
    from ..plans.plan import resolve_layers
    from ..tensor.from_plan import styles_by_path
    from ..tensor.tied import canonical_names, tie_groups

    canonical = canonical_names(tie_groups(model))
    resolved = resolve_layers(plan, model)
    experts = matching(plan.experts, model) if plan.experts is not None else []
    styles = styles_by_path(plan, model, [p for x in resolved for p in x.paths])
    named = list(model.named_parameters(remove_duplicate=False))
    layers = []
    for layer in resolved:
        params = []
        for name, p in named:
            owner, _, leaf = name.rpartition(".")
            if under_any(owner, list(layer.paths)):
                params.append(Param(canonical.get(name, name), p.numel(),
                                    _split(styles.get(owner, []), leaf),
                                    expert=under_any(owner, experts),
                                    rows=p.shape[0] if p.dim() else 1))
        layers.append(LayerShape(layer.name, tuple(params), layer.is_block))
    heads, hidden, ffn, vocab = dims or (cfg.n_head, cfg.n_embd, 4 * cfg.n_embd, VOCAB)
    return ModelShape(kind, tuple(layers), heads, hidden, ffn, cfg.block_size, vocab,
                      tuple(plan.divisible.items()),
                      getattr(cfg, "moe_top_k", 0) if getattr(cfg, "moe_experts", 0) else 0)


def llama_shape(cfg: Any) -> ModelShape:
    """A Llama as ``pycomm.parallel.train --model llama`` configures it (vocabulary 256, MLP
    width 4h, as many KV heads as heads), counted without transformers: embedding,
    blocks of q/k/v/o and gate/up/down projections (no biases) with two RMSNorms, the
    final norm and the head (tied to the embedding with ``tie_embeddings``); q/k/v,
    gate/up column-parallel, o/down row-parallel, embedding and head vocab-parallel."""
    h, f = cfg.n_embd, 4 * cfg.n_embd
    embed = Param("model.embed_tokens.weight", VOCAB * h, True, rows=VOCAB)
    layers = [LayerShape("model.embed_tokens", (embed,), False)]
    for i in range(cfg.n_layer):
        pre = f"model.layers.{i}"
        params = [Param(f"{pre}.self_attn.{x}_proj.weight", h * h, True) for x in "qkvo"]
        params += [Param(f"{pre}.mlp.{x}_proj.weight", h * f, True) for x in ("gate", "up",
                                                                              "down")]
        params += [Param(f"{pre}.{x}.weight", h, False) for x in ("input_layernorm",
                                                                  "post_attention_layernorm")]
        layers.append(LayerShape(pre, tuple(params), True))
    layers.append(LayerShape("model.norm", (Param("model.norm.weight", h, False),), False))
    head = embed if cfg.tie_embeddings else Param("lm_head.weight", VOCAB * h, True,
                                                  rows=VOCAB)
    layers.append(LayerShape("lm_head", (head,), False))
    return ModelShape("llama", tuple(layers), cfg.n_head, h, f, cfg.block_size, VOCAB,
                      (("attention heads", cfg.n_head),))


# HuggingFace families whose blocks' activations the planner counts: a gated MLP as
# Llama's (attention, then gate, up, SiLU, down), or GPT-2's as the project GPT's
_HF_KINDS = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
             "gpt2": "gpt"}


def model_shape(cfg: Any) -> ModelShape:
    """The shape of the trainer's model for ``cfg`` (a :class:`TrainConfig`): the GPT
    (and a HuggingFace model where transformers is installed: ``--model llama``,
    ``qwen2``, ``mistral``, ``gpt2``, ``hf:CONFIG.json``) built on the meta device and
    read through its plan; a Llama without transformers by :func:`llama_shape`.

    Raises:
        ValueError: a HuggingFace family whose activations the planner does not count.
    """
    import dataclasses

    from .._optional import available
    from ..compose.parallelize import plan_for
    from ..job.models import build_model

    if cfg.model == "llama" and available("transformers") is None:
        return llama_shape(cfg)
    model = build_model(dataclasses.replace(cfg, init="meta"))
    if cfg.model == "gpt" and not getattr(cfg, "from_pretrained", ""):
        return from_model(model, plan_for(model), "gpt", cfg)
    config: Any = model.config
    kind = _HF_KINDS.get(config.model_type)
    if kind is None:
        raise ValueError(f"plan: model_type {config.model_type!r} is not modelled (the "
                         f"planner counts the activations of {sorted(_HF_KINDS)})")
    hidden = int(config.hidden_size)
    ffn = (getattr(config, "n_inner", None) or 4 * hidden) if kind == "gpt" else \
        config.intermediate_size
    dims = (int(config.num_attention_heads), hidden, int(ffn), int(config.vocab_size))
    return from_model(model, plan_for(model), kind, cfg, dims)
