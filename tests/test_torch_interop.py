"""Unchanged torch training code on the candidate backend against the same code on gloo.

DDP, FSDP2, DTensor tensor parallelism and pipelining run once per backend (one
spawn of all scenarios per backend and world size, shared by the tests below);
each test compares the candidate's results with gloo's and with a single-process
run of the same model on the whole batch (``_interop_models.reference_run``).

The candidate is conftest's ``backend`` ("pycomm"); ``PYCOMM_TEST_BACKEND=gloo``
(or ``--backend=gloo``) checks the test itself, gloo against gloo.

c10d::Backend methods these scenarios reach (traced on torch 2.13 with gloo):
DDP: broadcast (initial sync), allgather (parameter shape check), allreduce SUM
(one per bucket). FSDP2: _allgather_base, _reduce_scatter_base with AVG,
allgather_into_tensor_coalesced (``full_tensor``). Tensor parallel: scatter and
broadcast (``distribute_tensor``), allreduce SUM, allgather_into_tensor_coalesced.
Pipelining (GPipe, 1F1B): send and recv only (object metadata travels as tensors).
"""

import pytest
import torch
from _interop_models import reference_run
from _interop_scenarios import SCENARIOS, run_scenarios

REFERENCE = "gloo"
# Backends differ in reduction order; 2-rank sums of two floats do not, but means may.
BACKEND_TOL = {"rtol": 1e-5, "atol": 1e-6}
# Against one process on the whole batch: per-rank means are averaged, not one mean.
SINGLE_TOL = {"rtol": 1e-4, "atol": 1e-5}
DDP_CASES = {"ddp": {}, "ddp_bucket_view": {"model": "transformer"}, "ddp_no_sync": {"micro": 2}}


def _run_both(candidate: str, world: int, names: list[str]) -> dict[str, list[dict]]:
    """Run the scenarios once per backend; results[backend slot][rank][scenario]."""
    if candidate == "pycomm" and "pycomm" not in torch.distributed.Backend.backend_list:
        pytest.fail("import pycomm did not register the 'pycomm' backend", pytrace=False)
    from pycomm.testing import run_ranks

    return {
        slot: run_ranks(run_scenarios, world, names, backend=name, timeout_s=300.0)
        for slot, name in (("candidate", candidate), ("reference", REFERENCE))
    }


@pytest.fixture(scope="module")
def world2(backend) -> dict[str, list[dict]]:
    """Every scenario at world size 2, on both backends."""
    return _run_both(backend, 2, list(SCENARIOS))


@pytest.fixture(scope="module")
def world3(backend) -> dict[str, list[dict]]:
    """Plain DDP at world size 3 (odd ranks, no power-of-two shortcuts), both backends."""
    return _run_both(backend, 3, ["ddp"])


def _scenario(runs: dict, name: str) -> tuple[list[dict], list[dict]]:
    """(candidate, reference) per-rank results of one scenario."""
    return [r[name] for r in runs["candidate"]], [r[name] for r in runs["reference"]]


def _assert_replicas_equal(ranks: list[dict], name: str) -> None:
    """Every rank ends with bit-identical parameters (they applied the same update)."""
    for rank, result in enumerate(ranks[1:], start=1):
        for i, (p0, p) in enumerate(zip(ranks[0]["params"], result["params"], strict=True)):
            assert torch.equal(p0, p), f"{name}: rank {rank} parameter {i} differs from rank 0"


def _check_ddp(runs: dict, name: str, world: int, **ref_kwargs) -> None:
    """Replicas agree bit for bit; candidate matches gloo and the single process."""
    cand, ref = _scenario(runs, name)
    _assert_replicas_equal(cand, name)
    _assert_replicas_equal(ref, name)
    for c, g in zip(cand, ref, strict=True):
        torch.testing.assert_close(c["params"], g["params"], **BACKEND_TOL)
        torch.testing.assert_close(c["losses"], g["losses"], **BACKEND_TOL)
    single = reference_run(world, **ref_kwargs)
    torch.testing.assert_close(cand[0]["params"], single["params"], **SINGLE_TOL)
    mean_losses = torch.tensor([c["losses"] for c in cand]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(single["losses"]), **SINGLE_TOL)


@pytest.mark.parametrize("name", list(DDP_CASES))
def test_ddp_matches_gloo(world2, name):
    _check_ddp(world2, name, 2, **DDP_CASES[name])


def test_ddp_uses_several_buckets(world2):
    cand, _ = _scenario(world2, "ddp")
    assert cand[0]["buckets"] >= 3


def test_ddp_world3_matches_gloo(world3):
    _check_ddp(world3, "ddp", 3)


def test_fsdp2_matches_gloo(world2):
    cand, ref = _scenario(world2, "fsdp2")
    _assert_replicas_equal(cand, "fsdp2")
    for c, g in zip(cand, ref, strict=True):
        torch.testing.assert_close(c["params"], g["params"], **BACKEND_TOL)
        torch.testing.assert_close(c["losses"], g["losses"], **BACKEND_TOL)
    single = reference_run(2, optim="adam")
    torch.testing.assert_close(cand[0]["params"], single["params"], **SINGLE_TOL)
    mean_losses = torch.tensor([c["losses"] for c in cand]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(single["losses"]), **SINGLE_TOL)


def test_tensor_parallel_matches_gloo(world2):
    cand, ref = _scenario(world2, "tensor_parallel")
    single = reference_run(2)
    keys = ("out", "x_grad", "grads", "params", "losses")
    for c, g in zip(cand, ref, strict=True):
        for key in keys:
            torch.testing.assert_close(c[key], g[key], **BACKEND_TOL, msg=key)
            torch.testing.assert_close(c[key], single[key], **SINGLE_TOL, msg=key)


@pytest.mark.parametrize("name", ["pipeline_gpipe", "pipeline_1f1b"])
def test_pipeline_matches_gloo(world2, name):
    cand, ref = _scenario(world2, name)
    for c, g in zip(cand, ref, strict=True):
        for key in ("grads", "params", "losses"):
            torch.testing.assert_close(c[key], g[key], **BACKEND_TOL, msg=key)
    single = reference_run(2)
    for key in ("grads", "params"):  # stage 0 holds the first two tensors
        torch.testing.assert_close(cand[0][key] + cand[1][key], single[key], **SINGLE_TOL)
    last_losses = torch.tensor(cand[1]["losses"]).mean(1)  # mean over micro-batches
    torch.testing.assert_close(last_losses, torch.tensor(single["losses"]), **SINGLE_TOL)
