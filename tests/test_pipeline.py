"""pycomm.parallel.pipeline: the schedules and helpers as pure functions, and K = 2, 3, 4 stages
(one spawn each) against the unpartitioned model on one process."""

import pytest
import torch
from _pp_scenarios import MICRO, MODES, SCHEDULES, reference, run_all

from pycomm.parallel.pipeline import gpipe_schedule, one_f_one_b_schedule, split_batch
from pycomm.parallel.pipeline.balance import partition
from pycomm.parallel.pipeline.schedule import in_flight


def _rows(schedule):
    return [" ".join(map(str, steps)) for steps in schedule]


def test_gpipe_schedule_is_the_drawn_table():
    assert _rows(gpipe_schedule(4, 3)) == ["F0 F1 F2 F3 B3 B2 B1 B0"] * 3


def test_1f1b_schedule_is_the_drawn_table():
    assert _rows(one_f_one_b_schedule(4, 3)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


@pytest.mark.parametrize("micro", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_1f1b_holds_at_most_k_minus_s_micro_batches_gpipe_all(micro, stages):
    for s, (g, f) in enumerate(zip(gpipe_schedule(micro, stages),
                                   one_f_one_b_schedule(micro, stages), strict=True)):
        assert in_flight(g) == micro
        assert in_flight(f) == min(stages - s, micro)
        for steps in (g, f):  # every micro-batch forward once and backward once
            assert sorted((x.kind, x.micro) for x in steps) == sorted(
                [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])


def test_partition_minimises_the_largest_stage():
    assert partition([1] * 6, 3) == [2, 2, 2]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        partition([1, 1], 3)


def test_split_batch_handles_uneven_rows_nesting_and_plain_values():
    parts = split_batch({"x": torch.arange(10), "pair": (torch.ones(10, 2), "tag"), "k": 3}, 4)
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [p["pair"][0].shape[0] for p in parts] == [3, 3, 2, 2]
    assert all(p["pair"][1] == "tag" and p["k"] == 3 for p in parts)


def test_balance_helpers_cover_the_model():
    from _pp_scenarios import model

    from pycomm.parallel.pipeline.balance import balance_by_size, balance_by_time

    net, sample = model(), torch.randn(4, 16)
    for fn in (balance_by_size, balance_by_time):
        balance = fn(3, net, sample)
        assert len(balance) == 3 and sum(balance) == len(net) and min(balance) >= 1


@pytest.fixture(scope="module")
def single():
    return reference()


@pytest.fixture(scope="module", params=[2, 3, 4])
def pipe(request, require_pycomm):
    from pycomm.testing import run_ranks

    return request.param, run_ranks(run_all, request.param, request.param, timeout_s=600.0)


def _check(ranks, key, single):
    grads = {}
    for r in ranks:
        run = r[key]
        assert run["loss"] == pytest.approx(single["loss"], rel=1e-5), key
        grads.update(run["grads"])
    assert grads.keys() == single["grads"].keys()
    for name, grad in single["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{key} {name}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("micro", MICRO)
def test_loss_and_every_gradient_match_one_process(pipe, single, micro, schedule, mode):
    _, ranks = pipe
    _check(ranks, ("pycomm", micro, schedule, mode), single)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("micro", MICRO)
def test_gloo_gives_the_same(pipe, single, micro, schedule):
    _, ranks = pipe
    _check(ranks, ("gloo", micro, schedule, "except_last"), single)


@pytest.mark.parametrize("group", ["pycomm", "gloo"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_repeated_steps_with_receives_posted_ahead_accumulate_exactly(pipe, group, schedule):
    from _pp_scenarios import reference_repeated

    _, ranks = pipe
    single = reference_repeated()
    grads = {}
    for r in ranks:
        grads.update(r[("repeated", group, schedule)]["grads"])
    for name, grad in single["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for r in ranks:  # 4 micro-batches a step, from each neighbour the stage has
        run = r[("repeated", group, schedule)]
        neighbours = (not run["first"]) + (not run["last"])
        # the first step and the one with new shapes receive when needed, the others
        # had their receives posted ahead
        assert run["receives"] == {"posted_ahead": 2 * 4 * neighbours,
                                   "received_now": 2 * 4 * neighbours}, run["receives"]


def test_dict_micro_batches_with_a_plain_value_reach_the_first_layer(pipe):
    _, ranks = pipe
    _check(ranks, "dict", reference(dict_input=True))


def test_rematerialization_replays_dropout(pipe):
    _, ranks = pipe
    for r in ranks:
        never, always = r[("dropout", "never")], r[("dropout", "always")]
        assert never["loss"] == always["loss"]
        for name, grad in never["grads"].items():
            assert torch.equal(grad, always["grads"][name]), name


def test_trace_has_every_step_of_every_stage(pipe):
    size, ranks = pipe
    for r in ranks:
        run = r[("pycomm", 4, "1f1b", "never")]
        assert sorted(run["events"]) == sorted([("F", m) for m in range(4)]
                                               + [("B", m) for m in range(4)])
        assert run["all_events"] == 8 * size


def test_bad_input_raises_on_every_rank(pipe):
    size, ranks = pipe
    for r in ranks:
        bad = r["bad"]
        assert "the batch has 2 rows, fewer than chunks=4" in bad["few_rows"]
        assert "inputs have 10 rows but the last stage's targets 7" in bad["targets"]
        assert f"covers {size} layers, the module has 12" in bad["balance"]
        assert "schedule must be one of" in bad["schedule"]
