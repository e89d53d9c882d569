"""The pycomm backend on CUDA tensors (``pytest -m gpu``): 2 and 4 ranks sharing one GPU
through the CUDA-IPC ring, every collective x dtype against the CPU reference, async
ops on side streams, a DDP step, FSDP2 and tensor-parallel (DTensor) steps, and a CuPy
array via DLPack. Skipped without a GPU, or
with a CPU-only pycomm._C where no nvcc could have built a CUDA one; a pycomm._C that
does not load fails them (require_pycomm)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from pycomm.testing import RankPool
from tests import _cuda_scenarios as sc


def _cuda_unavailable() -> str:
    """A named missing resource, or "" (then the tests run, and fail if the build is bad)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        from pycomm import _C  # type: ignore[attr-defined]
    except ImportError:
        return ""  # require_pycomm fails every test, saying why
    if _C.cuda_built():
        return ""
    from torch.utils import cpp_extension

    if shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
        return "no nvcc: pycomm._C was built without CUDA"
    return ""  # nvcc is here, so a CPU-only pycomm._C is a build to fix: the tests fail


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_pycomm"),
              pytest.mark.skipif(bool(_cuda_unavailable()), reason=_cuda_unavailable() or "-")]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=60.0) as p:
        yield p


def test_every_collective_matches_the_cpu_reference(pool):
    for rank, failures in enumerate(pool.run(sc.every_collective, timeout_s=300)):
        assert failures == [], f"rank {rank}: {failures}"


def test_rooted_and_coalesced_ops_match_the_cpu_reference(pool):
    for rank, failures in enumerate(pool.run(sc.rooted_and_coalesced_ops, timeout_s=300)):
        assert failures == [], f"rank {rank}: {failures}"


def test_the_fast_paths_take_the_cuda_path(pool):
    for rank, failures in enumerate(pool.run(sc.fast_paths_take_the_cuda_path)):
        assert failures == [], f"rank {rank}: {failures}"


def test_async_op_on_a_side_stream(pool):
    for rank, failures in enumerate(pool.run(sc.async_and_streams)):
        assert failures == [], f"rank {rank}: {failures}"


def test_ddp_step_on_cuda_matches_one_process(pool):
    for rank, diff in enumerate(pool.run(sc.ddp_step_matches_single_process)):
        assert diff < 1e-5, f"rank {rank}: parameters differ by {diff}"


def test_fsdp2_steps_on_cuda_match_one_process(pool):
    for rank, diff in enumerate(pool.run(sc.fsdp2_steps_match_single_process)):
        assert diff < 1e-5, f"rank {rank}: parameters differ by {diff}"


def test_tensor_parallel_steps_on_cuda_match_one_process(pool):
    for rank, diff in enumerate(pool.run(sc.tensor_parallel_steps_match_single_process)):
        assert diff < 1e-5, f"rank {rank}: parameters differ by {diff}"


def test_cupy_array_through_dlpack(pool):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("no CuPy (pip install '.[cupy]')")
    for rank, failure in enumerate(pool.run(sc.cupy_all_reduce)):
        assert failure == "", f"rank {rank}: {failure}"


def test_a_cuda_op_after_shutdown_raises(pool):
    for rank, failure in enumerate(pool.run(sc.op_after_shutdown_raises)):
        assert failure == "", f"rank {rank}: {failure}"


def test_abort_reaches_peers_waiting_in_a_cuda_op(pool):
    for rank, failure in enumerate(pool.run(sc.abort_reaches_peers_in_a_cuda_op)):
        assert failure == "", f"rank {rank}: {failure}"


def test_list_forms_are_complete_when_wait_returns(pool):
    for rank, failures in enumerate(pool.run(sc.list_forms_complete_after_copy_back)):
        assert failures == [], f"rank {rank}: {failures}"


def test_is_completed_asks_the_gpu(pool):
    for rank, failure in enumerate(pool.run(sc.is_completed_follows_the_gpu)):
        assert failure == "", f"rank {rank}: {failure}"
