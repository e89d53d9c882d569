"""Mixtures of experts against one process (``tests/test_moe.py``): the project's GPT with
experts, HuggingFace Mixtral and Qwen3-MoE from configs (4 experts, top-2, a load-balancing
coefficient of 0.02: HuggingFace's with ``output_router_logits``), on real batches, in the
layouts of the composition matrix (GPipe's schedule where there are micro-batches: the load
balance counts the whole batch before any backward). One process computes HuggingFace's
own objective: the cross-entropy over the targets that are not ignored plus
``coef * aux_loss`` (its ``load_balancing_loss_func`` over every layer and every real
token; the GPT's ``forward_with_aux``, the same function)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import _real_batch_scenarios as rb

MODELS = ("gpt", "mixtral", "qwen3_moe")
CASES = ("ignored", "right_pad")
COEF = 0.02


def build(name: str) -> nn.Module:
    if name == "gpt":
        from pycomm.parallel.models import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=rb.VOCAB, block_size=rb.SEQ, n_layer=2, n_head=4,
                             n_embd=32, moe_experts=4, moe_top_k=2, moe_aux_coef=COEF,
                             moe_intermediate=64))
    import transformers

    common = dict(vocab_size=rb.VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=rb.SEQ, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=COEF,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, **common))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=4, moe_intermediate_size=32, head_dim=8, norm_topk_prob=True, **common))


def one_process(name: str, case: str, steps: int, model: nn.Module | None = None
                ) -> list[tuple[float, float]]:
    from pycomm.parallel.checkpointing.optim_groups import param_groups

    model = model if model is not None else build(name)
    opt = torch.optim.AdamW(param_groups(list(model.parameters()), rb.DECAY), lr=rb.LR)
    out = []
    for step in range(steps):
        b = rb.batch(case, step)
        opt.zero_grad()
        logits, aux = _forward(model, b)
        loss = F.cross_entropy(logits.reshape(-1, rb.VOCAB), b.targets.reshape(-1),
                               ignore_index=rb.IGNORE) + COEF * aux
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), rb.CLIP)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


def _forward(model: nn.Module, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the load-balancing loss (without its coefficient)."""
    if hasattr(model, "forward_with_aux"):  # the project's GPT
        return model.forward_with_aux(b.tokens, **b.inputs())
    result = model(b.tokens, **b.inputs(), use_cache=False)
    return result.logits, result.aux_loss


def layouts() -> dict[str, tuple[int, int, int, int, dict[str, Any]]]:
    """name -> (dp, tp, pp, ep, config): the composition matrix, under GPipe's schedule
    where there are micro-batches, and expert parallelism over the data-parallel ranks
    (the experts beside ZeRO 1-3, whole on their ranks, reduced over edp)."""
    out = {}
    for name, (dp, tp, pp, config) in rb.LAYOUTS.items():
        if "offload" in config:  # not in the experts matrix (with ep > 1, refused by name)
            continue
        config = {k: v for k, v in config.items() if k != "sequence_parallel"}
        if config.get("microbatches", 1) > 1:
            config["schedule"] = "gpipe"
        out[name.replace("+SP", "")] = (dp, tp, pp, 1, config)
        ep_layout = (dp, tp, pp, 2, config)
        if dp > 1 and ep_layout not in out.values():
            out[f"{name.replace('+SP', '')} ep2"] = ep_layout
    out["dp2 ep2 zero1"] = (2, 1, 1, 2, {"zero": 1})
    out["ep4"] = (4, 1, 1, 4, {})
    out["ep4 zero2"] = (4, 1, 1, 4, {"zero": 2})
    out["dp4 ep2 zero1"] = (4, 1, 1, 2, {"zero": 1})  # experts replicated over edp = 2
    out["dp4 ep2 zero3"] = (4, 1, 1, 2, {"zero": 3})
    out["dp2 ep2 recompute"] = (2, 1, 1, 2, {"recompute": True})  # routers rerun in backward
    return out


ONE = "1 process"  # the engine on one rank: the reference of a mixed-precision recipe


def layout_of(name: str) -> tuple[int, int, int, int, dict[str, Any]]:
    return (1, 1, 1, 1, {}) if name == ONE else layouts()[name]


def world_of(layout: str) -> int:
    dp, tp, pp, _, _ = layout_of(layout)
    return dp * tp * pp


def rotation(layout: str) -> list[tuple[str, str]]:
    """The (model, case) pairs a layout runs in the tests: every case, the model turning
    with the layout and the case (all of them: ``pairs=None``)."""
    i = list(layouts()).index(layout)
    return [(MODELS[(i + j) % len(MODELS)], case) for j, case in enumerate(CASES)]


def engine_in(layout: str, model: nn.Module, precision: str | None = None
              ) -> tuple[Any, Any]:
    """``model`` parallelized in ``layout`` with the tests' AdamW recipe (computing in
    ``precision``, fp32 masters); (engine, mesh)."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, ep, config = layout_of(layout)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp, ep=ep)
    return parallelize(model, mesh, ParallelConfig(
        max_grad_norm=rb.CLIP, weight_decay=rb.DECAY, optimizer_kwargs={"lr": rb.LR},
        precision=precision, **config)), mesh


def curves(layout: str, steps: int, pairs: list[tuple[str, str]] | None = None,
           precision: str | None = None) -> dict[tuple[str, str], list[tuple[float, float]]]:
    out = {}
    for name, case in pairs or [(m, c) for m in MODELS for c in CASES]:
        engine, mesh = engine_in(layout, build(name), precision)
        curve = []
        for step in range(steps):
            b = rb.batch(case, step)
            r = engine.train_step(b.tokens, b.targets, **b.inputs())
            curve.append((r.loss, r.grad_norm))
        out[(name, case)] = curve
        mesh.destroy()
    return out


def refusal(shape: dict[str, int], config: dict[str, Any], name: str = "mixtral") -> str:
    """The error ``parallelize`` raises for ``name`` (one of ours, or of the real-batch
    models: no experts) in this layout, or ""."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(**shape)
    try:
        model = build(name) if name in MODELS else rb.build(name)
        parallelize(model, mesh, ParallelConfig(**config))
    except ValueError as err:
        return str(err)
    finally:
        mesh.destroy()
    return ""


def save_and_resume(saver: str, loader: str, path: str, name: str, steps: int = 3,
                    saved_at: int = 1) -> tuple[list[float], list[float]]:
    """``name`` trained ``steps`` steps in layout ``saver`` (saving after ``saved_at``),
    and the steps after it resumed in ``loader`` (another ep, ZeRO stage or tp)."""
    def run(engine: Any, first: int, end: int) -> list[float]:
        return [engine.train_step((b := rb.batch("ignored", s)).tokens, b.targets,
                                  **b.inputs()).loss for s in range(first, end)]

    engine, mesh = engine_in(saver, build(name))
    whole = run(engine, 0, saved_at)
    engine.save(path, {"step": saved_at})
    whole += run(engine, saved_at, steps)
    mesh.destroy()
    engine, mesh = engine_in(loader, build(name))
    start = engine.load(path)["step"]
    resumed = run(engine, start, steps)
    mesh.destroy()
    return whole[start:], resumed


def export_reloads(layout: str, root: str) -> float:
    """Mixtral trained a step in ``layout`` (experts split by ep), saved, exported as a
    HuggingFace folder (rank 0) and reloaded by ``from_pretrained``: the largest
    difference of its logits from the engine's."""
    import torch.distributed as dist
    import transformers

    from pycomm.parallel.compose.export import save_pretrained

    model = build("mixtral")
    engine, mesh = engine_in(layout, model)
    b = rb.batch("ignored", 0)
    engine.train_step(b.tokens, b.targets)
    engine.save(f"{root}/ckpt", {"step": 1})
    want = engine.logits(b.tokens)
    mesh.destroy()
    diff = torch.zeros(1)
    if dist.get_rank() == 0:
        save_pretrained(f"{root}/ckpt", model.config, f"{root}/hf")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/hf").eval()
        with torch.no_grad():
            got = reloaded(b.tokens, use_cache=False).logits
        diff[0] = (got - want).abs().max()
    dist.broadcast(diff, 0)
    return float(diff)


# -- expert capacity (token dropping) -------------------------------------------------------

CAPACITY = {"capacity_factor": 1.0}  # 4 experts top-2: room for half a call's tokens each


def chunks_of(layout: str) -> int:
    """The experts calls one step's rows are cut into: one per replica and micro-batch
    (each call's capacity is its own, as Megatron's is per rank)."""
    dp, _, _, _, config = layout_of(layout)
    return dp * config.get("microbatches", 1)


def _router_logits(model: nn.Module, tokens: torch.Tensor, inputs: dict[str, Any]
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits and every layer's router logits ``(rows * seq, E)``."""
    if hasattr(model, "forward_with_aux"):  # the project's GPT
        from pycomm.parallel.models.gpt_moe import router_logits

        with router_logits(model) as found:
            out = model(tokens, inputs.get("attention_mask"), inputs.get("position_ids"))
        return out, list(found)
    result = model(tokens, **inputs, use_cache=False, output_router_logits=True)
    return result.logits, list(result.router_logits)


def _aux(model: nn.Module, layers: list[torch.Tensor], mask: torch.Tensor | None
         ) -> torch.Tensor:
    if hasattr(model, "forward_with_aux"):
        from pycomm.parallel.models.gpt_moe import load_balancing_loss

        return load_balancing_loss(layers, 4, 2, mask)
    import importlib

    family = importlib.import_module(type(model).__module__)
    return family.load_balancing_loss_func(tuple(layers), 4, 2, mask)


def one_process_capacity(name: str, case: str, steps: int, chunks: int,
                         policy: str = "probs") -> list[tuple[float, float, int]]:
    """One process with the capacity (``pycomm.parallel.moe.capacity``'s drop on each experts
    module): the global batch's rows in ``chunks`` forwards, each its own capacity, one
    objective over all of them (the cross-entropy over the global count, the aux loss over
    every chunk's routing); per step (loss, gradient norm, dropped assignments)."""
    from pycomm.parallel.checkpointing.optim_groups import param_groups
    from pycomm.parallel.compose.parallelize import plan_for
    from pycomm.parallel.moe.capacity import DropCounter, limit_capacity
    from pycomm.parallel.plans.plan import matching

    model = build(name)
    counter = DropCounter(counts=True)
    for path in matching(plan_for(model).experts, model):
        limit_capacity(model.get_submodule(path), 4, CAPACITY["capacity_factor"], policy,
                       counter)
    opt = torch.optim.AdamW(param_groups(list(model.parameters()), rb.DECAY), lr=rb.LR)
    out = []
    for step in range(steps):
        b = rb.batch(case, step)
        opt.zero_grad()
        counter.reset()
        rows, inputs = b.tokens.shape[0] // chunks, b.inputs()
        ce, routed = torch.zeros(()), []
        for c in range(chunks):
            part = slice(c * rows, (c + 1) * rows)
            logits, layers = _router_logits(model, b.tokens[part],
                                            {k: v[part] for k, v in inputs.items()})
            ce = ce + F.cross_entropy(logits.reshape(-1, rb.VOCAB),
                                      b.targets[part].reshape(-1), ignore_index=rb.IGNORE,
                                      reduction="sum")
            routed.append(layers)
        per_layer = [torch.cat([chunk[i] for chunk in routed]) for i in range(len(routed[0]))]
        aux = _aux(model, per_layer, inputs.get("attention_mask"))
        loss = ce / (b.targets != rb.IGNORE).sum() + COEF * aux
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), rb.CLIP)
        opt.step()
        out.append((loss.item(), norm.item(), int(counter.local[0])))
    return out


def capacity_curves(layout: str, steps: int, pairs: list[tuple[str, str]],
                    policy: str = "probs"
                    ) -> dict[tuple[str, str], list[tuple[float, float, int]]]:
    """``curves`` with the capacity: (loss, gradient norm, dropped) per step."""
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    dp, tp, pp, ep, config = layout_of(layout)
    out = {}
    for name, case in pairs:
        mesh = ParallelMesh(pp=pp, dp=dp, tp=tp, ep=ep)
        engine = parallelize(build(name), mesh, ParallelConfig(
            max_grad_norm=rb.CLIP, weight_decay=rb.DECAY, optimizer_kwargs={"lr": rb.LR},
            drop_policy=policy, **CAPACITY, **config))
        curve = []
        for step in range(steps):
            b = rb.batch(case, step)
            r = engine.train_step(b.tokens, b.targets, **b.inputs())
            curve.append((r.loss, r.grad_norm, r.dropped))
        out[(name, case)] = curve
        mesh.destroy()
    return out


def meta_curves(layout: str, steps: int, name: str
                ) -> tuple[list[tuple[float, float]], int]:
    """``name`` built on the meta device and parallelized in ``layout`` (each rank
    materializing what it holds; under ep only its experts): (loss, grad norm) per step,
    and the most experts this rank ever initialised in one experts module."""
    from pycomm.parallel.compose.materialize import Materializer

    made: list[int] = []
    init_experts = Materializer._init_experts

    def counted(self: Any, path: str, module: nn.Module, first: int) -> None:
        made.append(next(iter(module._parameters.values())).shape[0])
        init_experts(self, path, module, first)

    Materializer._init_experts = counted  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            model = build(name)
        engine, mesh = engine_in(layout, model)
    finally:
        Materializer._init_experts = init_experts  # type: ignore[method-assign]
    curve = []
    for step in range(steps):
        b = rb.batch("right_pad", step)
        r = engine.train_step(b.tokens, b.targets, **b.inputs())
        curve.append((r.loss, r.grad_norm))
    mesh.destroy()
    return curve, max(made, default=0)


def one_process_meta(name: str, steps: int) -> list[tuple[float, float]]:
    """``one_process`` from the weights a meta-device build gets in one process."""
    from pycomm.parallel.compose.materialize import materialize
    from pycomm.parallel.compose.parallelize import plan_for

    with torch.device("meta"):
        model = build(name)
    plan = plan_for(model)
    materialize(model, seed=0, init=plan.init, experts=plan.experts)
    return one_process(name, "right_pad", steps, model=model)
