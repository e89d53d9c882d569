"""A plan: what each part of a model becomes under every strategy, by module path.

``parallelize`` never asks what class a module is; it reads the plan. A plan names

- ``layers``: the model's forward as an ordered sequence a pipeline can cut between
  (``"blocks.*"`` stands for one layer per child of that ``ModuleList``), each layer a
  tuple of module paths and, where it is not "call them one after the other", a ``call``;
- ``blocks``: which of those layers are the repeated ones (the transformer blocks). They
  are what the pipeline balances over its stages, the default recompute and ZeRO-3
  units, and the sequence-parallel region;
- ``tp``: module path pattern -> style (:mod:`pycomm.parallel.tensor.styles`), e.g.
  ``{"blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise"}``;
- ``context``: values every block receives, computed once per micro-batch from the
  batch's shape and its :class:`ModelInputs` (a rotary table, the attention masks), so
  that each pipeline stage computes them itself;
- ``inputs``: which model inputs beside the tokens the plan honours (``attention_mask``,
  ``position_ids``); a batch that brings one the plan does not name is refused;
- ``output``: how the model's output becomes logits (HuggingFace: ``.logits``).

Tied parameters (one ``nn.Parameter`` reached by two names, as ``lm_head.weight`` and
``wte.weight``) need no entry: they are found by identity.

Patterns match module paths one component at a time; ``*`` matches one component:
``"layers.*.self_attn.q_proj"`` matches ``layers.0.self_attn.q_proj``.

Example (the plan of a model whose forward is ``head(norm(blocks(embed(x))))``)::

    Plan(layers=["embed", "blocks.*", "norm", "head"], blocks="blocks.*",
         tp={"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise",
             "embed": "vocab_embedding", "head": "vocab_head"})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the plan names them; it needs neither to be one
    from ..moe.balance import RouterBalance
    from ..tensor.styles import Style

# call(modules, x, context) -> x: one pipeline layer's forward.
LayerCall = Callable[[Sequence[nn.Module], Any, dict[str, Any]], Any]


MODEL_INPUTS = ("attention_mask", "position_ids")


@dataclass(frozen=True)
class ModelInputs:
    """What a model takes beside its tokens, for the rows a layer computes, in
    HuggingFace's conventions: ``attention_mask`` ``(batch, seq)``, 1 for a real token and
    0 for padding (left or right); ``position_ids`` ``(batch, seq)``, restarting at 0 at
    each document packed into a row (attention then stays inside each document, as with
    HuggingFace's ``DataCollatorWithFlattening``)."""

    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def given(self) -> dict[str, torch.Tensor]:
        """The inputs that are set, by name (the keyword arguments of a model's forward)."""
        return {k: v for k in MODEL_INPUTS if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class ContextRequest:
    """What a plan's ``context`` is computed from: the whole batch's shape (the full
    sequence, also where this rank holds a part of it), the activations' dtype and
    device, and the micro-batch's :class:`ModelInputs` (None: every token real, one
    document per row)."""

    batch: int
    seq: int
    dtype: torch.dtype
    device: torch.device
    inputs: ModelInputs | None = None

    def position_ids(self) -> torch.Tensor:
        """The inputs' position ids, or ``0 .. seq-1`` for every row (shape (1, seq))."""
        if self.inputs is not None and self.inputs.position_ids is not None:
            return self.inputs.position_ids
        return torch.arange(self.seq, device=self.device).unsqueeze(0)

    def attention_mask(self) -> torch.Tensor | None:
        return self.inputs.attention_mask if self.inputs is not None else None


@dataclass(frozen=True)
class Layer:
    """One step of the forward: the modules it runs (paths from the model's root; one may
    end in ``.*``: one layer per child) and how (``call``; default: one after another,
    each given the previous one's output)."""

    modules: tuple[str, ...]
    call: LayerCall | None = None

    @classmethod
    def of(cls, spec: Layer | str) -> Layer:
        return spec if isinstance(spec, Layer) else cls((spec,))


def call_with_inputs(modules: Sequence[nn.Module], x: Any, context: dict[str, Any]) -> Any:
    """A layer that is a whole model: its forward gets the batch's model inputs as keywords
    (``model(tokens, attention_mask=...)``, as a HuggingFace model takes them)."""
    inputs = context.get("inputs")
    return modules[0](x, **(inputs.given() if inputs is not None else {}))


@dataclass
class Plan:
    """How to parallelize one model (see the module docstring).

    Args:
        layers: the forward as a sequence of layers (default: the whole model as one
            layer: no pipeline can cut it).
        blocks: pattern of the repeated layers (``"blocks.*"``), or None.
        tp: module path pattern -> tensor-parallel style.
        context: ``fn(ContextRequest) -> dict`` of keyword values for every block call.
        output: ``fn(model output) -> logits`` (default: the output itself).
        recompute: patterns of the activation-checkpointing units (default: the blocks).
        zero3_units: patterns of ZeRO-3's gather units (default: the blocks).
        divisible: ``{what: count}`` that the tensor-parallel size must divide (heads).
        init: ``init(path, module)`` initialises one module's own parameters (for a model
            built on the meta device; default: its ``reset_parameters()``).
        inputs: the model inputs beside the tokens the plan honours (names from
            ``MODEL_INPUTS``): its context or its layer calls read them from
            :class:`ModelInputs`.
        experts: pattern of the fused experts modules (HuggingFace's ``*Experts``), which
            expert parallelism splits (``ep``); None: the model has none.
        balance: the routers of a mixture of experts and its load-balancing loss
            (:class:`pycomm.parallel.moe.balance.RouterBalance`), which the step adds to the loss
            over the whole global batch; None: no such loss.
        unsplit_reason: why the plan is the whole model as one layer where a plan of its
            layers was sought (a derivation's refusal); a layout that needs the layers
            (tp, pp, sequence parallelism, recompute) is refused quoting it.
        name: what error messages call the model.
    """

    layers: list[Layer | str] = field(default_factory=lambda: [Layer(("",), call_with_inputs)])
    blocks: str | None = None
    tp: dict[str, Style | str | tuple[Style | str, ...]] = field(default_factory=dict)
    context: Callable[[ContextRequest], dict[str, Any]] | None = None
    output: Callable[[Any], torch.Tensor] | None = None
    recompute: list[str] | None = None
    zero3_units: list[str] | None = None
    divisible: dict[str, int] = field(default_factory=dict)
    init: Callable[[str, nn.Module], None] | None = None
    inputs: tuple[str, ...] = ()
    experts: str | None = None
    balance: RouterBalance | None = None
    unsplit_reason: str = ""
    name: str = "model"

    def is_whole_model(self) -> bool:
        """Whether the plan's one layer is the whole model (nothing to cut or split)."""
        return len(self.layers) == 1 and Layer.of(self.layers[0]).modules == ("",)

    def recompute_patterns(self) -> list[str]:
        return self.recompute if self.recompute is not None else _listed(self.blocks)

    def zero3_patterns(self) -> list[str]:
        return self.zero3_units if self.zero3_units is not None else _listed(self.blocks)


def _listed(pattern: str | None) -> list[str]:
    return [pattern] if pattern else []


def matches(pattern: str, path: str) -> bool:
    """Whether module ``path`` matches ``pattern`` (``*``: any one path component)."""
    want, have = pattern.split(".") if pattern else [], path.split(".") if path else []
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have,
                                                                          strict=True))


def under_any(path: str, prefixes: list[str]) -> bool:
    """Whether module ``path`` is one of ``prefixes`` or inside one ("" is the root)."""
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def planned_units(patterns: list[str], planned: Sequence[Any], model: nn.Module
                  ) -> list[nn.Module]:
    """The modules of a pipeline stage's ``planned`` layers (each with ``.layer.paths``)
    that ``patterns`` name: a whole planned layer where a pattern names the layer's one
    module, else the submodule itself (a recompute unit, a ZeRO-3 gather unit)."""
    out: list[nn.Module] = []
    for layer in planned:
        paths: tuple[str, ...] = layer.layer.paths
        if len(paths) == 1 and any(matches(pat, paths[0]) for pat in patterns):
            out.append(layer)
            continue
        for path, module in model.named_modules(remove_duplicate=False):
            if under_any(path, list(paths)) and any(matches(pat, path) for pat in patterns):
                out.append(module)
    return out


def matching(pattern: str, model: nn.Module) -> list[str]:
    """Every module path of ``model`` that ``pattern`` matches, in module order."""
    return [name for name, _ in model.named_modules(remove_duplicate=False)
            if matches(pattern, name)]


@dataclass(frozen=True)
class ResolvedLayer:
    """A layer of a plan with its patterns expanded: the concrete module paths."""

    index: int
    paths: tuple[str, ...]
    call: LayerCall | None
    is_block: bool

    @property
    def name(self) -> str:
        return "+".join(p or "<root>" for p in self.paths)


def resolve_layers(plan: Plan, model: nn.Module) -> list[ResolvedLayer]:
    """The plan's layers on ``model``, a layer per child where a path ends in ``.*``.

    Raises:
        ValueError: naming a path the model lacks, or a layer with two ``.*`` paths.
    """
    out: list[ResolvedLayer] = []
    modules = dict(model.named_modules(remove_duplicate=False))
    for spec in map(Layer.of, plan.layers):
        starred = [p for p in spec.modules if p.endswith("*")]
        if len(starred) > 1:
            raise ValueError(f"plan for {plan.name}: layer {spec.modules} repeats over two "
                             "module lists; give each its own layer")
        for paths in _expand(spec.modules, starred, model, plan.name):
            for p in paths:
                if p not in modules:
                    raise ValueError(f"plan for {plan.name}: layer names module {p!r}, "
                                     f"which the model ({type(model).__name__}) does not have")
            is_block = plan.blocks is not None and any(matches(plan.blocks, p) for p in paths)
            out.append(ResolvedLayer(len(out), paths, spec.call, is_block))
    return out


def _expand(paths: tuple[str, ...], starred: list[str], model: nn.Module,
            name: str) -> list[tuple[str, ...]]:
    if not starred:
        return [paths]
    pattern = starred[0]
    found = matching(pattern, model)
    if not found:
        raise ValueError(f"plan for {name}: layer pattern {pattern!r} matches no module of "
                         f"{type(model).__name__}")
    return [tuple(f if p == pattern else p for p in paths) for f in found]
