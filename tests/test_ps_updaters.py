"""pycomm.parallel.ps.updaters against torch's optimizers with one optimizer per key, stepped only
for the keys a push touches; FTRL against a NumPy transcription of McMahan et al. (2013),
Algorithm 1. Rows a push does not touch must stay bit-identical."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pycomm.parallel.ps.updaters import CallableUpdater, Updater, make_updater

pytestmark = pytest.mark.usefixtures("require_pycomm")

N, D = 12, 5
# The rows of each push: scattered (gathered copies), one run (updated in place through a
# view), a single row, every row, none, and keys pushed for the first time late.
PUSH_ROWS = [[0, 3, 4, 9], [2, 3, 4, 5], [7], list(range(N)), [], [1, 3, 5, 7, 11], [4, 5, 6],
             [10, 11]]

TORCH_CASES = [
    ({"name": "sgd", "lr": 0.1}, torch.optim.SGD),
    ({"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, torch.optim.SGD),
    ({"name": "sgd", "lr": 0.05, "momentum": 0.8, "dampening": 0.3}, torch.optim.SGD),
    ({"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True}, torch.optim.SGD),
    ({"name": "adagrad", "lr": 0.1}, torch.optim.Adagrad),
    ({"name": "adagrad", "lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.02,
      "initial_accumulator_value": 0.3, "eps": 1e-6}, torch.optim.Adagrad),
    ({"name": "adam", "lr": 0.01}, torch.optim.Adam),
    ({"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
     torch.optim.Adam),
    ({"name": "adam", "lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
     torch.optim.AdamW),
]


def _pushes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.tensor(r, dtype=torch.int64), torch.randn(len(r), D, generator=g))
            for r in PUSH_ROWS]


def _initial(seed: int) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed))


def _run_ps(spec: dict | str | Updater, init: torch.Tensor, pushes) -> tuple[torch.Tensor, dict]:
    """The pushes through the updater, checking after each that untouched rows (values and
    state) kept their bits and that the caller's gradients were not written."""
    u = make_updater(spec)
    values, state = init.clone(), u.init_state(N, D)
    for rows, grads in pushes:
        before = [values.clone(), *(t.clone() for t in state.values())]
        grads_in = grads.clone()
        u.apply(values, state, rows, grads)
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[rows] = False
        for old, new in zip(before, [values, *state.values()], strict=True):
            assert torch.equal(old[untouched], new[untouched])
        assert torch.equal(grads, grads_in)
    return values, state


def _run_torch(spec: dict, optimizer: type, init: torch.Tensor, pushes) -> torch.Tensor:
    """One torch parameter per key; a key not in a push has no grad, so torch skips it."""
    kwargs = {k: tuple(v) if k == "betas" else v for k, v in spec.items()
              if k not in ("name", "decoupled_weight_decay")}
    params = [torch.nn.Parameter(row.clone()) for row in init]
    opt = optimizer(params, foreach=False, **kwargs)
    for rows, grads in pushes:
        for p in params:
            p.grad = None
        for r, g in zip(rows.tolist(), grads, strict=True):
            params[r].grad = g.clone()
        opt.step()
    return torch.stack([p.detach() for p in params])


@pytest.mark.parametrize(("spec", "optimizer"), TORCH_CASES,
                         ids=[f"{s['name']}-{i}" for i, (s, _) in enumerate(TORCH_CASES)])
def test_matches_torch_optimizer_per_key(spec, optimizer):
    init, pushes = _initial(1), _pushes(2)
    got, _ = _run_ps(spec, init, pushes)
    torch.testing.assert_close(got, _run_torch(spec, optimizer, init, pushes), rtol=1e-6,
                               atol=1e-7)


def _ftrl_reference(pushes, alpha: float, beta: float, l1: float, l2: float) -> np.ndarray:
    """Algorithm 1 of McMahan et al. (2013), per coordinate, in float64."""
    z, n = np.zeros((N, D)), np.zeros((N, D))

    def weight(r: int, i: int) -> float:
        if abs(z[r, i]) <= l1:
            return 0.0
        return -(z[r, i] - np.sign(z[r, i]) * l1) / ((beta + math.sqrt(n[r, i])) / alpha + l2)

    for rows, grads in pushes:
        for r, g_row in zip(rows.tolist(), grads.double().numpy(), strict=True):
            for i, g in enumerate(g_row):
                w = weight(r, i)  # the weight the gradient was taken at
                sigma = (math.sqrt(n[r, i] + g * g) - math.sqrt(n[r, i])) / alpha
                z[r, i] += g - sigma * w
                n[r, i] += g * g
    return np.array([[weight(r, i) for i in range(D)] for r in range(N)])


@pytest.mark.parametrize("params", [(0.1, 1.0, 0.0, 0.0), (0.5, 1.0, 0.6, 0.3),
                                    (1.0, 0.5, 1.5, 0.0)])
def test_ftrl_matches_the_paper(params):
    alpha, beta, l1, l2 = params
    pushes = _pushes(3)
    spec = {"name": "ftrl", "alpha": alpha, "beta": beta, "l1": l1, "l2": l2}
    got, _ = _run_ps(spec, torch.zeros(N, D), pushes)
    expected = _ftrl_reference(pushes, alpha, beta, l1, l2)
    assert torch.equal(got == 0, torch.from_numpy(expected == 0))  # l1's exact zeros
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-7)
    if l1 >= 1.0:
        assert (got == 0).any()


def clipped_step(values, grads, state, lr, clip):
    """A user rule for the callable tests: counts pushes, sums grads, clipped SGD step."""
    state["pushes"] += 1
    state["total"] += grads
    return values - lr * grads.clamp(-clip, clip)


CALLABLE = {"name": "callable", "target": "test_ps_updaters:clipped_step",
            "state": {"total": "dim", "pushes": 1}, "lr": 0.5, "clip": 1.0}


def test_callable_by_import_path():
    init, pushes = _initial(4), _pushes(5)
    values, state = _run_ps(CALLABLE, init, pushes)
    expected, total, count = init.clone(), torch.zeros(N, D), torch.zeros(N, 1)
    for rows, grads in pushes:
        expected[rows] -= 0.5 * grads.clamp(-1, 1)
        total[rows] += grads
        count[rows] += 1
    assert torch.equal(values, expected)
    assert torch.equal(state["total"], total) and torch.equal(state["pushes"], count)


def wrong_shape(values, grads, state):
    return values[:, :1]


def test_callable_result_of_wrong_shape():
    u = make_updater({"name": "callable", "target": "test_ps_updaters:wrong_shape"})
    values = torch.zeros(N, D)
    with pytest.raises(ValueError, match=r"wrong_shape returned \(2, 1\), expected .*\(2, 5\)"):
        u.apply(values, {}, torch.tensor([1, 4]), torch.ones(2, D))
    assert torch.equal(values, torch.zeros(N, D))


@pytest.mark.parametrize("spec", [s for s, _ in TORCH_CASES] + [
    {"name": "ftrl", "alpha": 0.3, "l1": 0.2}, CALLABLE, "sgd", "adam", "adagrad", "ftrl"])
def test_spec_round_trip(spec):
    u = make_updater(spec)
    again = make_updater(json.loads(json.dumps(u.spec())))
    assert again == u and type(again) is type(u)
    init, pushes = _initial(6), _pushes(7)
    a, _ = _run_ps(u, init, pushes)
    b, _ = _run_ps(again, init, pushes)
    assert torch.equal(a, b)
    assert make_updater(u) is u


@pytest.mark.parametrize(("spec", "message"), [
    ("nope", r"unknown updater 'nope'; valid names: \['adagrad', 'adam', 'callable', 'ftrl'"),
    ({"lr": 0.1}, r"unknown updater None; valid names"),
    (42, r"an updater spec is a name, a dict or an Updater, got 42"),
    ({"name": "sgd", "momentun": 0.9}, r"'sgd': unknown key\(s\) \['momentun'\]; valid keys: "
     r"\['dampening', 'lr', 'momentum', 'nesterov', 'weight_decay'\]"),
    ({"name": "sgd", "lr": -1}, r"'sgd': lr must be a finite number >= 0.0, got -1"),
    ({"name": "sgd", "lr": "0.1"}, r"lr must be a finite number >= 0.0, got '0.1'"),
    ({"name": "sgd", "nesterov": True}, r"nesterov needs momentum > 0 and dampening == 0"),
    ({"name": "adam", "betas": [0.9]}, r"betas must be \[beta1, beta2\], got \[0.9\]"),
    ({"name": "adam", "betas": [0.9, 1.0]}, r"betas\[1\] must be a finite number >= 0 and < 1"),
    ({"name": "adam", "decoupled_weight_decay": 1}, r"decoupled_weight_decay must be true or"),
    ({"name": "adagrad", "eps": float("nan")}, r"eps must be a finite number >= 0.0, got nan"),
    ({"name": "ftrl", "alpha": 0}, r"alpha must be a finite number > 0.0, got 0"),
    ({"name": "callable", "target": "math"}, r"target must be 'package.module:function'"),
    ({"name": "callable", "target": "no_such_module:f"}, r"cannot import 'no_such_module:f'"),
    ({"name": "callable", "target": "math:pi"}, r"'math:pi' is not callable"),
    ({"name": "callable", "target": "test_ps_updaters:clipped_step", "lr": 1.0},
     r"clipped_step cannot take the keywords \['lr'\]"),
    ({"name": "callable", "target": "test_ps_updaters:wrong_shape", "state": {"s": 0}},
     r"state\['s'\] must be 'dim' or an int >= 1, got 0"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        make_updater(spec)


def _adam_table() -> tuple[Updater, torch.Tensor, dict]:
    u = make_updater("adam")
    return u, torch.zeros(N, D), u.init_state(N, D)


@pytest.mark.parametrize(("rows", "grads", "message"), [
    ([1, 2, 3], torch.ones(3, D + 1), r"grads must be float32 of shape \(3, 5\) \(rows, d\), "
     r"got torch.float32 \(3, 6\)"),
    ([1, 2], torch.ones(3, D), r"shape \(2, 5\) .*got torch.float32 \(3, 5\)"),
    ([1, 2], torch.ones(2, D, dtype=torch.float64), r"got torch.float64 \(2, 5\)"),
    ([0, N], torch.ones(2, D), rf"row {N} is out of range for a table of N={N} rows"),
    ([-1, 3], torch.ones(2, D), rf"row -1 is out of range for a table of N={N} rows"),
    ([3, 1], torch.ones(2, D), r"sorted and unique: rows\[1\]=1 follows rows\[0\]=3"),
    ([2, 2], torch.ones(2, D), r"sorted and unique: rows\[1\]=2 follows rows\[0\]=2"),
])
def test_bad_pushes_are_refused_before_any_write(rows, grads, message):
    u, values, state = _adam_table()
    with pytest.raises(ValueError, match=message):
        u.apply(values, state, torch.tensor(rows), grads)
    assert not values.any() and not any(t.any() for t in state.values())


def test_bad_tables_are_refused():
    u, values, state = _adam_table()
    rows, grads = torch.tensor([0]), torch.ones(1, D)
    with pytest.raises(ValueError, match=r"rows must be a 1-D int64 tensor, got torch.int32"):
        u.apply(values, state, rows.int(), grads)
    with pytest.raises(ValueError, match=r"state\['exp_avg_sq'\] must be contiguous float32 of "
                       r"shape \(12, 5\), got missing"):
        u.apply(values, {"exp_avg": state["exp_avg"], "step": state["step"]}, rows, grads)
    with pytest.raises(ValueError, match=r"values must be a contiguous \(N, d\) float32"):
        u.apply(values.t(), state, rows, grads)


def test_state_columns_and_zero_state():
    assert make_updater("sgd").state_columns(D) == {}
    assert make_updater({"name": "sgd", "momentum": 0.5}).state_columns(D) == {
        "momentum_buffer": D, "step": 1}
    assert make_updater("adam").state_columns(D) == {"exp_avg": D, "exp_avg_sq": D, "step": 1}
    assert make_updater("ftrl").state_columns(3) == {"z": 3, "n": 3}
    u = make_updater(CALLABLE)
    assert isinstance(u, CallableUpdater) and u.state_columns(7) == {"total": 7, "pushes": 1}
    assert all(not t.any() and t.dtype == torch.float32 for t in u.init_state(4, 7).values())
