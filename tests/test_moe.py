"""Mixtures of experts (the project's GPT with experts, Mixtral, Qwen3-MoE) train as one
process does, the load-balancing loss included: the routing statistics of the whole
global batch (every replica, micro-batch and pipeline stage) before the formula, in every
layout of the composition matrix, experts split by tensor parallelism at tp > 1 or by
expert parallelism (``tests/_moe_scenarios.py``; each layout runs both cases, the model
turning with the layout). A 1F1B schedule with micro-batches, which starts a backward
before the last forward, is refused by name. The trainer trains a Mixtral from a config
and the GPT with ``--moe-experts``."""

from __future__ import annotations

import pytest
import torch

from pycomm.testing import RankPool
from tests import _moe_scenarios as sc
from tests import _real_batch_scenarios as rb

pytestmark = pytest.mark.usefixtures("require_pycomm")

REL = 1e-5
STEPS = 3


@pytest.fixture(scope="module")
def references():
    return {(m, c): sc.one_process(m, c, STEPS) for m in sc.MODELS for c in sc.CASES}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_trains_experts_and_their_balance_as_one_process(references, world):
    layouts = [name for name in sc.layouts() if sc.world_of(name) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for layout in layouts:
            for got in pool.run(sc.curves, layout, STEPS, sc.rotation(layout)):
                for key, curve in got.items():
                    loss, norm = rb.worst_relative(curve, references[key])
                    assert loss < REL and norm < REL, (layout, key, loss, norm)


def test_micro_batches_under_1f1b_are_refused_with_a_load_balancing_loss():
    with RankPool(2, backend="pycomm", pg_timeout_s=60) as pool:
        for message in pool.run(sc.refusal, {"dp": 2}, {"microbatches": 2, "schedule": "1f1b"}):
            assert "load-balancing loss" in message and "gpipe" in message, message


def test_offload_with_expert_parallelism_is_refused_by_name():
    config = {"zero": 3, "offload": "cpu", "max_grad_norm": None}
    with RankPool(2, backend="pycomm", pg_timeout_s=60) as pool:
        for message in pool.run(sc.refusal, {"dp": 2, "ep": 2}, config):
            assert "offload='cpu' cannot run with ep=2" in message, message


# (saver, loader): experts split by ep saved, read whole or by another ep, ZeRO or tp
RESHARDS = [("dp2 ep2 zero1", "dp2"), ("dp2", "dp2 ep2"), ("dp2 ep2", "tp2"),
            ("dp2 zero3 ep2", "dp2 ep2 zero1"), ("dp2 zero3", "dp2 zero3 ep2"),
            ("ep4", "dp4 ep2 zero1"), ("dp4 ep2 zero1", "ep4 zero2"),
            ("dp4 ep2 zero3", "ep4")]


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoints_reshard_experts_across_ep_zero_and_tp(tmp_path, world):
    """Saved with the experts split one way, resumed split another: the resumed steps'
    losses equal the uninterrupted run's."""
    pairs = [(a, b) for a, b in RESHARDS if sc.world_of(a) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for i, (saver, loader) in enumerate(pairs):
            model = sc.MODELS[i % len(sc.MODELS)]
            whole, resumed = pool.run(sc.save_and_resume, saver, loader,
                                      str(tmp_path / f"pair{i}"), model)[0]
            for got, want in zip(resumed, whole, strict=True):
                assert abs(got / want - 1) < REL, (saver, loader, model, got, want)
        if world == 2:  # the HF export of experts split by ep, reloaded by from_pretrained
            for layout in ("dp2 ep2 zero1", "dp2 zero3 ep2"):
                diffs = pool.run(sc.export_reloads, layout, str(tmp_path / layout))
                assert max(diffs) < 1e-5, (layout, diffs)


def test_the_trainer_trains_a_mixtral_with_expert_parallelism(tmp_path):
    """The README's command, shortened: a Mixtral-shaped model from a config file, dp2 with
    ep2, its load-balancing loss in every step's record; with a capacity, the dropped
    assignments counted there too."""
    import json

    from tests.test_train import train

    metrics = tmp_path / "m.jsonl"
    done = train("--model", "hf:examples/mixtral-tiny.json", "--dp", 2, "--ep", 2,
                 "--steps", 2, "--eval-every", 0, "--block-size", 32, "--batch-size", 4,
                 "--moe-capacity-factor", 1.0, "--no-progress", "--metrics", metrics)
    assert "dp2 (ep2)" in done.stdout + done.stderr
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    assert len(steps) == 2 and all(0 < r["aux_loss"] < r["loss"] for r in steps), steps
    # 4 experts top-2 over 2 x 64 tokens: a capacity of 1.0 leaves no room for imbalance
    assert any(r["dropped"] > 0 for r in steps), steps


def test_the_trainer_trains_the_gpt_with_experts_and_expert_parallelism(tmp_path):
    """docs/composition.md's command, shortened: --model gpt --moe-experts 4 --moe-top-k 2
    at dp2 with ep2, its load-balancing loss in every step's record."""
    import json

    from tests.test_train import train

    metrics = tmp_path / "m.jsonl"
    done = train("--model", "gpt", "--moe-experts", 4, "--moe-top-k", 2, "--dp", 2, "--ep", 2,
                 "--n-layer", 2, "--n-embd", 64, "--steps", 2, "--eval-every", 0,
                 "--block-size", 32, "--batch-size", 4, "--no-progress", "--metrics", metrics)
    out = done.stdout + done.stderr
    assert "4 experts top-2" in out and "dp2 (ep2)" in out, out
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    # 0.01 x aux; aux is k = 2 when the routing is balanced, at most E = 4
    assert len(steps) == 2 and all(0.015 < r["aux_loss"] <= 0.04 for r in steps), steps


def test_the_planner_predicts_the_experts_memory_as_measured():
    """bench.moe_memory's check in small: each rank's expert parameters, gradients and
    optimizer state after a step equal the formula and the planner's prediction, the
    experts split by ep and, where edp > 1, sharded over edp by their own ZeRO."""
    from bench import moe_memory as mm

    layouts = [(2, 0), (2, 1), (2, 3), (4, 2)]
    with RankPool(4, backend="pycomm", pg_timeout_s=120) as pool:
        for ep, zero in layouts:
            want = mm.formula(ep, zero)
            assert mm.planned(ep, zero) == want, (ep, zero)
            for got in pool.run(mm.measure, ep, zero):
                assert got == want, (ep, zero, got, want)


# (layout, drop policy): experts capped at capacity factor 1.0, each call its own capacity
CAPPED = [("dp2", "probs"), ("dp2 ep2", "probs"), ("dp2 zero3 ep2", "position"),
          ("dp2 M=2 ep2", "probs"), ("tp2", "position"), ("ep4", "probs"),
          ("dp2 x tp2 ep2", "position"), ("pp2 x dp2 ep2", "probs"),
          ("dp2 ep2 recompute", "probs")]  # a rerun forward's drops are not counted again


@pytest.mark.parametrize("world", [2, 4])
def test_a_capacity_drops_the_same_assignments_as_one_process(world):
    """capacity_factor: every layout drops what one process drops when it computes each
    replica's micro-batch as its own call (Megatron's per-rank capacity) - the same count
    of dropped assignments in every step, the loss and gradient norm within 1e-5."""
    layouts = [(name, policy) for name, policy in CAPPED if sc.world_of(name) == world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for i, (layout, policy) in enumerate(layouts):
            pairs = [(sc.MODELS[(i + j) % len(sc.MODELS)], case)
                     for j, case in enumerate(sc.CASES)]
            for got in pool.run(sc.capacity_curves, layout, STEPS, pairs, policy):
                for key, curve in got.items():
                    want = sc.one_process_capacity(*key, STEPS, sc.chunks_of(layout), policy)
                    assert [c[2] for c in curve] == [w[2] for w in want], (layout, key)
                    assert all(w[2] > 0 for w in want), "the capacity dropped nothing"
                    loss, norm = rb.worst_relative([c[:2] for c in curve],
                                                   [w[:2] for w in want])
                    assert loss < REL and norm < REL, (layout, key, loss, norm)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_kept_assignments_are_each_experts_first_by_the_policy(policy):
    """pycomm.parallel.moe.capacity.kept against a loop over the experts."""
    from pycomm.parallel.moe.capacity import capacity_of, kept

    gen = torch.Generator().manual_seed(3)
    for tokens, k, experts, factor in [(16, 2, 4, 1.0), (33, 1, 8, 0.5), (20, 3, 5, 1.3)]:
        index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=gen)
        got = kept(index, weights, experts, factor, policy)
        room = capacity_of(tokens, k, experts, factor)
        want = torch.zeros(tokens, k, dtype=torch.bool)
        for e in range(experts):
            places = [(t, j) for t in range(tokens) for j in range(k) if index[t, j] == e]
            if policy == "probs":
                places.sort(key=lambda tj: -float(weights[tj]))
            for t, j in places[:room]:
                want[t, j] = True
        assert torch.equal(got, want), (tokens, k, experts, factor)


def test_a_capacity_is_refused_without_experts_or_with_a_bad_value():
    cases = [("llama", {"capacity_factor": 1.0}, "the plan for LlamaForCausalLM names none"),
             ("mixtral", {"capacity_factor": 0.0}, "capacity_factor must be > 0"),
             ("mixtral", {"capacity_factor": 1.0, "drop_policy": "random"},
              "drop_policy must be one of")]
    with RankPool(2, backend="pycomm", pg_timeout_s=60) as pool:
        for name, config, wanted in cases:
            for message in pool.run(sc.refusal, {"dp": 2}, config, name):
                assert wanted in message, (name, config, message)


@pytest.mark.parametrize("world", [2, 4])
def test_a_meta_model_materializes_only_each_ranks_experts(world):
    """Built on the meta device, a rank of an ep layout initialises only its E / ep
    experts (expert by expert, from the seed, the path and the expert's index), and the
    job trains as one process does from the whole model materialized alike. (Qwen3-MoE at
    tp2 caught marks lost at materialization: its q/k norms, marked partial-gradient while
    still on the meta device, were 1e-4 off one process.)"""
    layouts = {2: ["dp2 ep2", "dp2 zero3 ep2", "tp2"], 4: ["ep4", "dp4 ep2 zero1"]}[world]
    with RankPool(world, backend="pycomm", pg_timeout_s=120) as pool:
        for i, layout in enumerate(layouts):
            name = sc.MODELS[i % len(sc.MODELS)]
            want = sc.one_process_meta(name, STEPS)
            ep = sc.layout_of(layout)[3]
            for curve, most in pool.run(sc.meta_curves, layout, STEPS, name):
                assert most == 4 // ep, (layout, name, most)
                loss, norm = rb.worst_relative(curve, want)
                assert loss < REL and norm < REL, (layout, name, loss, norm)
