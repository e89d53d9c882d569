"""The layout planner (pycomm.parallel.planner): its memory formulas against ZeRO's and Megatron's
hand-computed numbers, its layouts against what the trainer's own checks accept, a
prediction against a measured run, and ``pycomm.parallel.train --plan auto``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pycomm.parallel.job.config import TrainConfig
from pycomm.parallel.planner import activations as act
from pycomm.parallel.planner.layouts import Layout, candidates, enumerate_layouts, with_layout
from pycomm.parallel.planner.memory import Job, predict, states
from pycomm.parallel.planner.planner import job_of
from pycomm.parallel.planner.shapes import LayerShape, ModelShape, Param, model_shape

MIB = 1 << 20
JOB = Job(batch=8, bucket_mb=1000.0, schedule="1f1b", sequence_parallel=False, dropout=0.0)


def _big_shape(blocks: int = 2, numel: int = 1 << 18) -> ModelShape:
    """Blocks of one large parameter each (above ZeRO-3's persistence threshold, and a
    multiple of every alignment), so the paper's numbers hold exactly."""
    layers = tuple(LayerShape(f"b{i}", (Param(f"b{i}.w", numel, True),), True)
                   for i in range(blocks))
    return ModelShape("gpt", layers, heads=4, hidden=64, ffn=256, seq=16, vocab=256,
                      divisible=(("heads", 4),))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_model_states_are_zeros_split_of_16_psi(n):
    shape = _big_shape()
    psi = shape.total_params
    got = {z: states(shape, Layout(n, 1, 1, z, False, False), JOB, 0) for z in range(4)}
    total = {z: m.params + m.grads + m.optimizer for z, m in got.items()}
    assert total[0] == 16 * psi  # 4 + 4 + 8 bytes (fp32 parameters, gradients, Adam)
    assert total[1] == 8 * psi + 8 * psi // n  # P_os
    assert total[2] == (4 * psi + 12 * psi // n if n > 1 else 16 * psi)  # P_os+g
    assert total[3] == 16 * psi // n  # P_os+g+p
    # reducing after backward, a whole gradient's worth arrives beside the states: stage
    # 2's bucket buffers, stage 1's .grad tensors (copied into its arena afterwards)
    assert got[1].end_of_backward == got[2].end_of_backward == 4 * psi
    assert got[0].end_of_backward == got[3].end_of_backward == 0
    # stage 3's whole-unit buffers (gathered parameters and gradients) beside the shards
    assert got[3].buffers["zero3 pool"] == 4 * 4 * (1 << 18)


def test_tensor_and_pipeline_parallelism_split_the_parameters():
    shape = _big_shape(blocks=4)
    one = states(shape, Layout(1, 1, 1, 0, False, False), JOB, 0)
    assert states(shape, Layout(1, 2, 1, 0, False, False), JOB, 0).params == one.params // 2
    assert states(shape, Layout(1, 1, 2, 0, False, False), JOB, 1).params == one.params // 2


def test_activations_are_korthikantis_without_masks_in_fp32():
    shape = _big_shape()
    a = act.ActShape(rows=2, seq=16, tp=1, sequence_parallel=False, dropout=0.0)
    sbh = 2 * 16 * 64
    # sbh(34 + 5as/h) half-words: minus the 2 sbh of dropout masks and the 5as^2b of
    # the attention matrix (SDPA's fused kernel keeps none), 32 sbh; fp32: x 2 bytes
    assert act.block_saved(shape, a) == 64 * sbh
    tp2 = dataclasses.replace(a, tp=2)
    assert act.block_saved(shape, tp2) == 4 * (4 + 12 // 2) * sbh  # sbh(10 + 24/t)
    sp2 = dataclasses.replace(tp2, sequence_parallel=True)
    assert act.block_saved(shape, sp2) == 4 * 16 * sbh // 2  # everything over t
    assert act.checkpoint_kept(shape, a, False) == 4 * sbh  # full recompute: 2sbh
    assert act.checkpoint_kept(shape, tp2, True) == 4 * sbh // 2  # P_a
    # 1F1B: the first of p stages holds p micro-batches, GPipe all m
    assert act.in_flight("1f1b", 4, 0, 8) == 4 and act.in_flight("1f1b", 4, 3, 8) == 1
    assert act.in_flight("gpipe", 4, 3, 8) == 8


def _trainer_accepts(cfg: TrainConfig, layout: Layout) -> bool:
    """What the trainer itself checks before any step (config, then the engine's
    ParallelConfig.check and plan checks, run here without ranks)."""
    from pycomm.parallel.compose.layers import stage_balance
    from pycomm.parallel.compose.parallelize import plan_for
    from pycomm.parallel.job.config import parallel_config
    from pycomm.parallel.job.models import build_model
    from pycomm.parallel.planner.layouts import _ShapeMesh
    from pycomm.parallel.plans.plan import resolve_layers
    from pycomm.parallel.tensor.from_plan import check_divisible

    run = with_layout(cfg, layout)
    try:
        run.check()
        parallel_config(run).check(_ShapeMesh(run.layout))
        model = build_model(dataclasses.replace(run, init="meta"))
        plan = plan_for(model)
        check_divisible(plan, layout.tp)
        stage_balance(resolve_layers(plan, model), layout.pp, plan.name)
    except ValueError:
        return False
    return True


def test_enumeration_is_what_the_trainer_accepts():
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4)
    shape = model_shape(cfg)
    accepted, refused = enumerate_layouts(cfg, 4, shape, offloads=("none",))
    assert len(accepted) + len(refused) == len(candidates(4, ("none",)))
    for layout in accepted:
        assert _trainer_accepts(cfg, dataclasses.replace(layout, microbatches=1))
    for layout, why in refused:
        assert not _trainer_accepts(cfg, layout), (layout, why)
    reasons = " ".join(why for _, why in refused)
    assert "attention heads = 2, not divisible by tp = 4" in reasons  # the plan's check
    assert "pp = 4 stages" in reasons  # 2 blocks cannot fill 4 stages
    assert "set recompute=True" in reasons  # P_a needs recompute (ParallelConfig.check)
    assert {(x.dp, x.tp, x.pp) for x in accepted} == {(4, 1, 1), (2, 2, 1), (2, 1, 2),
                                                      (1, 2, 2)}


def test_a_refused_layout_is_refused_by_the_trainer_too():
    from pycomm.parallel.train import main

    # batch 4 cannot split over dp 4 x 4 micro-batches: the planner lists no such layout
    assert main(["--dp", "4", "--microbatches", "4", "--batch-size", "4"]) == 2


@pytest.mark.usefixtures("require_pycomm")
@pytest.mark.parametrize(("zero", "precision"), [(2, "fp32"), (3, "bf16")])
def test_prediction_of_a_measured_run_is_within_10_percent(zero, precision):
    """fp32 ZeRO-2, and bf16 ZeRO-3 (the units gathered in bf16, their gradients and
    the masters in fp32, the activations in bf16 but the loss's in fp32)."""
    from pycomm.testing import run_ranks
    from tests import _plan_predictor_scenarios as sc

    cfg = TrainConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=8,
                      dp=2, zero=zero, precision=precision, eval_every=0)
    shape = model_shape(cfg)
    layout = Layout(2, 1, 1, zero, False, False, microbatches=1)
    predicted = predict(shape, layout, job_of(cfg))[0].peak
    ranks = run_ranks(sc.measured, 2, cfg)
    for r in ranks:
        assert abs(predicted - r["peak"]) <= 0.10 * r["peak"], (predicted, r["peak"])


@pytest.mark.usefixtures("require_pycomm")
def test_plan_auto_trains_the_fastest_layout_that_fits(tmp_path, monkeypatch):
    from pycomm.parallel.planner.planner import GIB, evaluate
    from pycomm.parallel.train import main

    monkeypatch.setenv("HOME", str(tmp_path))  # the calibration cache goes there
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
             "--batch-size", "4", "--data", str(data), "--eval-every", "0",
             "--no-progress"]
    cfg = dataclasses.replace(TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=16,
                                          batch_size=4), data=str(data))
    rows, _ = evaluate(cfg, 2, 1e9)
    peaks = sorted(r.peak for r in rows)
    limit = peaks[len(peaks) // 2] / GIB  # about half fit (the prediction's margin kept)
    fitting = [r for r in evaluate(cfg, 2, limit)[0] if r.fits]
    assert 0 < len(fitting) < len(rows)
    metrics = tmp_path / "m.jsonl"
    assert main([*flags, "--plan", "auto", "--nproc", "2", "--memory-gb", str(limit),
                 "--steps", "1", "--metrics", str(metrics)]) == 0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    config = next(x for x in lines if x["kind"] == "config")
    best = min(fitting, key=lambda r: r.time.total).layout
    got = (config["dp"], config["tp"], config["pp"], config["zero"], config["recompute"],
           config["partition_activations"])
    assert got == (best.dp, best.tp, best.pp, best.zero, best.recompute,
                   best.partition_activations)
    assert any(x.get("step") == 1 for x in lines)


def test_plan_auto_counts_other_load(monkeypatch):
    """--plan-other-load reaches the planner: with many runnable processes beside the job,
    every layout's compute is shared among more, and the choice is made with that."""
    from pycomm.parallel.train import auto

    seen = {}

    def fake_choose(cfg, world, limit, **options):
        seen.update(options)
        raise ValueError("stop here")

    monkeypatch.setattr("pycomm.parallel.planner.planner.choose", fake_choose)
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4,
                      plan="auto", plan_other_load=3.5)
    with pytest.raises(ValueError, match="stop here"):
        auto.planned(cfg, 2)
    assert seen == {"other_load": 3.5}
    with pytest.raises(ValueError, match="plan_other_load must be >= 0"):
        TrainConfig(plan_other_load=-1.0).check()


def test_waiting_for_peers_counts_each_blocking_collective(tmp_path, monkeypatch):
    """The wait term: the probe's measured wait per collective, interpolated by the
    compute before it, times the layout's blocking collectives (none on one rank)."""
    from pycomm.parallel.planner.calibrate import Calibration
    from pycomm.parallel.planner.timing import SYNC_STRETCHES, _waits, sync_wait

    cal = Calibration(tmp_path / "cal.json")
    cal.values[f"{cal.machine}|sync|4|1"] = [0.001, 0.002, 0.004, 0.008]
    assert sync_wait(4, 1, SYNC_STRETCHES[0] / 2, cal) == 0.001  # nearest below
    assert sync_wait(4, 1, 1.0, cal) == 0.008  # nearest above
    middle = (SYNC_STRETCHES[1] + SYNC_STRETCHES[2]) / 2
    assert sync_wait(4, 1, middle, cal) == pytest.approx(0.003)
    monkeypatch.setattr("pycomm.parallel.planner.timing._cpus", lambda: 1)  # 64 ranks: probed at 4
    assert sync_wait(64, 1, 1.0, cal) == 0.008
    shape = model_shape(TrainConfig(n_layer=4, n_head=4, n_embd=64, block_size=16))
    for flags, expect in [({"tp": 2, "dp": 2}, 2 * 4 * 2 + 1), ({"pp": 2, "dp": 2}, 2 * 2 + 1),
                          ({"dp": 4, "zero": 3}, 3 * 4), ({"tp": 4, "recompute": True}, 6 * 4)]:
        layout = Layout(**{"dp": 1, "tp": 1, "pp": 1, "zero": 0, "recompute": False,
                           "partition_activations": False, **flags})
        if layout.pp > 1:
            layout = dataclasses.replace(layout, microbatches=2)
        cal.values[f"{cal.machine}|block|64|4|{shape.ffn}|4|16|{layout.tp}|False"] = [1e-3, 3e-3]
        waits = _waits(shape, layout, 4, 0.01, cal)
        assert sum(n for n, _ in waits) == expect, (flags, waits)
        assert all(c > 0 for _, c in waits)


def test_the_wait_probe_measures_real_ranks():
    from pycomm.parallel.planner.sync_probe import sync_waits

    waits = sync_waits(2, (0.001, 0.004))
    assert len(waits) == 2 and all(0.0 <= w < 0.5 for w in waits)
