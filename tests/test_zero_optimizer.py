"""pycomm.parallel.zero.ZeroOptimizer as a torch.optim.Optimizer (param groups, LR schedulers,
state_dict, zero_grad, hooks), stages 1-3 at 2 and 4 ranks against torch's AdamW in one
process (float64), and weights loaded into the model behind the optimizer's back."""

import ast
from pathlib import Path

import pytest
import torch
from _zero_optimizer_scenarios import REST_LR, reduce_later_reference, reference, run_all

STAGES = [1, 2, 3]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
EXACT64 = {"rtol": 1e-10, "atol": 1e-12}  # float64, only the summation order differs


def _spawn(size: int):
    from pycomm.testing import run_ranks

    return size, run_ranks(run_all, size, size, timeout_s=600.0)


@pytest.fixture(scope="module")
def world2(require_pycomm):
    return _spawn(2)


@pytest.fixture(scope="module")
def world4(world2):
    return _spawn(4)


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.getfixturevalue(f"world{request.param}")


def _same_on_every_rank(ranks, key, field="params"):
    for rank, r in enumerate(ranks[1:], start=1):
        for i, (a, b) in enumerate(zip(ranks[0][key][field], r[key][field], strict=True)):
            assert torch.equal(a, b), f"rank {rank} parameter {i} differs from rank 0"


@pytest.mark.parametrize("stage", STAGES)
def test_param_groups_follow_torch_adamw(world, stage):
    """Weight decay on matrices only and another LR for the rest, 6 steps: the same
    parameters as torch's AdamW with the same groups in one process."""
    size, ranks = world
    run = ranks[0][("groups", stage)]
    assert run["mixing_buckets"] > 0, "buckets must mix groups for this test to bite"
    cut = [r[("groups", stage)]["pieces"] > r[("groups", stage)]["shards"] for r in ranks]
    assert any(cut), "some rank's shard must hold both groups"
    _same_on_every_rank(ranks, ("groups", stage))
    single = reference(size, 6, schedule=False)
    torch.testing.assert_close(run["params"], single["params"], **EXACT64)


@pytest.mark.parametrize("stage", STAGES)
def test_an_lr_scheduler_drives_the_inner_optimizer(world, stage):
    """LambdaLR (warmup, then cosine) on ZeroOptimizer: each step uses the scheduled LR
    of each group (seen inside the inner optimizer by a post-hook) and ends where torch's
    AdamW under the same schedule ends."""
    size, ranks = world
    run = ranks[0][("schedule", stage)]
    single = reference(size, 8, schedule=True)
    assert run["lrs"] == single["lrs"] == run["used"]
    assert run["lrs"][0][1] == pytest.approx(REST_LR / 3)
    torch.testing.assert_close(run["params"], single["params"], **EXACT64)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_resumes_bit_identically(world, stage, precision):
    """Save model and optimizer after 3 steps; a fresh pair that loads them (at stages
    1-2 under bf16 in either order) takes the next 3 steps exactly as the original."""
    _, ranks = world
    mixed = PRECISIONS[precision]
    orders = (False, True) if mixed and stage != 3 else (False,)
    for r in ranks:
        for first in orders:
            run = r[("resume", stage, mixed, first)]
            assert run["resumed"] == run["rest"], f"optimizer first: {first}"
            for a, b in zip(run["resumed_params"], run["params"], strict=True):
                assert torch.equal(a, b), f"optimizer first: {first}"
            assert run["lr"] == 2e-3, "a group's changed LR is part of the state"


def test_load_state_dict_refuses_what_does_not_fit(world):
    _, ranks = world
    errors = ranks[-1]["load_errors"]
    assert "saved with stage 1, this optimizer has 2" in errors["stage"]
    assert "save_sharded" in errors["stage"]
    assert "world" in errors["world"] and "save_sharded" in errors["world"]
    assert "saved with rank" in errors["rank"]
    assert "layout (buckets)" in errors["buckets"]
    assert "precision" in errors["precision"] and "bfloat16" in errors["precision"]
    # Same layout, one group instead of two: the pieces differ where a shard holds both.
    assert "saved with groups [[0, 1" in errors["groups"] or "(pieces)" in errors["groups"]
    assert "not a ZeroOptimizer state_dict" in errors["plain"]
    assert "build a new ZeroOptimizer" in errors["add_group"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_weights_loaded_into_the_model_are_not_undone(world, stage, precision):
    """model.load_state_dict after training: the next forward computes with the loaded
    weights, and a step with LR 0 leaves them as loaded (before the fix, stages 1-2
    under bf16 copied the old fp32 masters back, and stage 3 forwarded a stale gathered
    copy)."""
    _, ranks = world
    for r in ranks:
        run = r[("undone", stage, PRECISIONS[precision])]
        assert run["same_forward"], "the forward after loading used other weights"
        assert run["kept"], "the step undid the loaded weights"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_loading_weights_then_training_equals_building_on_them(world, stage, precision):
    _, ranks = world
    for r in ranks:
        run = r[("loaded", stage, PRECISIONS[precision])]
        assert run["same_losses"] and run["same_params"], run


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage3_takes_shards_loaded_with_assign(world, precision):
    _, ranks = world
    for r in ranks:
        run = r[("loaded_assign", PRECISIONS[precision])]
        assert run["same_losses"] and run["same_params"], run


def test_new_parameter_data_is_taken_into_the_buffer(world):
    _, ranks = world
    for r in ranks:
        assert r["new_data"]["taken"]
        assert "convert the model before building" in r["new_data"]["dtype_error"]


@pytest.mark.parametrize("stage", STAGES)
def test_it_is_a_torch_optimizer(world, stage):
    """isinstance; step pre/post hooks around the inner step; step(closure) returns the
    loss; zero_grad() leaves no .grad, zero_grad(set_to_none=False) zeroes them in place,
    and both train the same; a group's LR set by hand applies at the next step."""
    _, ranks = world
    for r in ranks:
        run = r[("api", stage)]
        assert run["optimizer"]
        assert run["calls"] == [("pre", 0), ("post", 1)]
        assert run["closure_loss"] > 0 and run["had_grads"]
        assert run["none_after"], "zero_grad() must set every .grad to None"
        assert run["zeroed_in_place"]
        assert run["accumulate"], "set_to_none=False must not accumulate into the next step"
        assert run["lr_change"] == {"frozen": True, "others_moved": True}


def test_stage1_reduces_no_sync_gradients_outside_backward(world):
    size, ranks = world
    for r in ranks:
        torch.testing.assert_close(r["reduce_later"]["params"], reduce_later_reference(size),
                                   **EXACT64)


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the pycomm.parallel.zero modules it imports anywhere (functions and
    TYPE_CHECKING blocks included); ``__init__`` stands for the package. The package's
    modules import each other relatively (``from . import x``, ``from .x import y``)."""
    names = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in names:
        edges = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                edges |= {a.name if a.name in names else "__init__" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                edges.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import | ast.ImportFrom):
                targets = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                           else [a.name for a in node.names])
                assert not any("parallel.zero" in t for t in targets), (
                    f"{name}.py imports its own package absolutely: {ast.unparse(node)}")
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself, with the path back."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_import_cycles_in_parallel_zero():
    package = Path(__file__).resolve().parents[1] / "parallel" / "zero"
    graph = _import_graph(package)
    assert {"zero_optimizer", "sharded_model", "unit_grads"} <= set(graph)
    assert _cycles(graph) == []
