"""pycomm.parallel.data.DataParallel over 2, 3 and 4 ranks, on pycomm and on gloo.

One spawn per world size runs every scenario (``_dp_scenarios.run_all``) on both an
explicit pycomm group and an explicit gloo group; the tests below check the results
against one process trained on the concatenated batch.
"""

import pytest
import torch
from _dp_scenarios import STEPS, reference, run_all

GROUPS = ["pycomm", "gloo"]
SINGLE_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _spawn(size: int) -> tuple[int, list[dict]]:
    from pycomm.testing import run_ranks

    return size, run_ranks(run_all, size, size, timeout_s=400.0)


@pytest.fixture(scope="module")
def world2(require_pycomm) -> tuple[int, list[dict]]:
    return _spawn(2)


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request, require_pycomm) -> tuple[int, list[dict]]:
    if request.param == 2:
        return request.getfixturevalue("world2")
    return _spawn(request.param)


def _assert_replicas_identical(ranks: list[dict], what: str) -> None:
    for rank, result in enumerate(ranks[1:], start=1):
        for i, (p0, p) in enumerate(zip(ranks[0]["params"], result["params"], strict=True)):
            assert torch.equal(p0, p), f"{what}: rank {rank} parameter {i} differs from rank 0"


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", ["sgd", "no_sync"])
def test_sgd_matches_one_process_on_the_whole_batch(world, group, case):
    size, ranks = world
    results = [r[group][case] for r in ranks]
    _assert_replicas_identical(results, f"{group}/{case}")
    single = reference(size, "sgd", micro=2 if case == "no_sync" else 1)
    torch.testing.assert_close(results[0]["params"], single["params"], **SINGLE_TOL)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(single["losses"]), **SINGLE_TOL)


@pytest.mark.parametrize("group", GROUPS)
def test_adamw_loss_trajectory_matches_one_process(world, group):
    size, ranks = world
    results = [r[group]["adamw"] for r in ranks]
    _assert_replicas_identical(results, f"{group}/adamw")
    single = reference(size, "adamw")
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(single["losses"]), rtol=1e-4, atol=0)


@pytest.mark.parametrize("group", GROUPS)
def test_gradients_live_in_one_arena_allocated_once(world, group):
    _, ranks = world
    for rank, r in enumerate(ranks):
        result = r[group]["sgd"]
        stats = result["stats"]
        assert result["grads_in_arena"], f"rank {rank}: a .grad is not a view of the arena"
        assert result["arena_ptrs"] == 1, f"rank {rank}: the arena moved between steps"
        assert stats["shared"] == (group == "pycomm"), stats
        assert stats["reserved_bytes"] == stats["peak_bytes"], stats
        assert stats["buckets"] > 2, "the test model should fill several buckets"
        assert stats["collectives_issued"] == STEPS * stats["buckets"], stats
        caps = [4 * 1024] + [16 * 1024] * (stats["buckets"] - 1)
        for k, (nbytes, items, cap) in enumerate(
            zip(stats["bucket_bytes"], stats["params_per_bucket"], caps, strict=True)
        ):
            assert nbytes <= cap or items == 1, f"bucket {k}: {items} params, {nbytes} B > {cap}"


@pytest.mark.parametrize("group", GROUPS)
def test_first_bucket_starts_before_backward_ends(world, group):
    _, ranks = world
    for rank, r in enumerate(ranks):
        trace = r[group]["overlap"]
        launches = [t for kind, _, t in trace if kind == "launch"]
        last_ready = max(t for kind, _, t in trace if kind == "ready")
        backward_end = next(t for kind, _, t in trace if kind == "backward_end")
        assert len(launches) > 2
        assert launches[0] < last_ready < backward_end, (
            f"rank {rank}: the first bucket was launched only after every gradient was ready"
        )
        buckets_done = [k for kind, k, _ in trace if kind == "done"]
        assert buckets_done == sorted(buckets_done)


def test_pycomm_buckets_complete_in_launch_order(world):
    _, ranks = world
    for rank, r in enumerate(ranks):
        trace = r["pycomm"]["overlap"]
        completed = [k for kind, k, _ in trace if kind == "complete"]
        launched = [k for kind, k, _ in trace if kind == "launch"]
        assert completed == launched, f"rank {rank}: completion order {completed}"


@pytest.mark.parametrize("group", GROUPS)
def test_unused_parameters_are_named_or_handled(world, group):
    _, ranks = world
    for r in ranks:
        result = r[group]["unused"]
        assert "never_used.weight" in result["error"], result["error"]
        assert "find_unused_parameters=True" in result["error"]
        assert result["never_used_grad"] is None, "a parameter no rank used got a gradient"
        assert result["head_grad"].abs().sum() > 0
    for r in ranks[1:]:
        mine, first = r[group]["unused"], ranks[0][group]["unused"]
        assert torch.equal(mine["head_grad"], first["head_grad"])
        for g0, g in zip(first["gpt_grads"], mine["gpt_grads"], strict=True):
            assert torch.equal(g0, g)


@pytest.mark.parametrize("group", GROUPS)
def test_no_memory_growth_after_the_first_steps(world2, group):  # one RSS probe is enough
    _, ranks = world2
    for rank, r in enumerate(ranks):
        result = r[group]["memory"]
        growth = result["rss"][10] - result["rss"][2]
        # Gradients are 5.6 MB: gradients or buckets kept per step would add that each
        # step (45 MB over 8 steps). The allocator and gloo's lazily grown buffers move
        # RSS by up to ~3 MB on a busy machine, so the bound is one set of gradients.
        assert growth < result["grad_bytes"], (
            f"rank {rank}: RSS grew {growth} bytes between steps 2 and 10"
        )
