#!/usr/bin/env bash
# The GPU check of the CUDA path, in one go (about 6 minutes on an H200): build with CUDA
# (registers and spills of every kernel from -Xptxas -v), a two-rank smoke test, the GPU
# tests, then the CUDA collectives and the copy-reduce kernel against the device's copy
# bandwidth. Each stage has its own time limit and log under $OUT, and a failing stage
# does not stop the ones after it (only a failed build does), so one run says as much as
# it can. The summary comes last. Needs a CUDA build of torch and nvcc; runs offline
# (nothing is downloaded); run from the repository root.
set -uo pipefail
out="${OUT:-/tmp/pycomm-gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary=()
stage() {  # stage NAME LIMIT_S CMD...: run CMD under a limit, log it, record the outcome
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -25 "$out/$name.log"
  summary+=("$(printf '%-10s rc=%-3s %4ds' "$name" "$rc" $((SECONDS - t0)))")
  return $rc
}

python -c "import torch, setuptools; assert torch.cuda.is_available(), 'no CUDA'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), \
'setuptools', setuptools.__version__)" | tee "$out/env.txt" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv >>"$out/env.txt" 2>&1
nproc >>"$out/env.txt"

# The editable install a user would make; offline, so no dependency resolution. Where the
# image's setuptools cannot read pyproject.toml, build in place instead (same sources).
export PYCOMM_PTXAS_VERBOSE=1 PYCOMM_CUDA_ARCH="${PYCOMM_CUDA_ARCH:-90}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
stage build 420 bash -c 'pip install --no-build-isolation --no-deps --no-index -e . -v ||
  { echo "== pip failed; python setup.py build_ext --inplace"; python setup.py build_ext --inplace; }' || { echo "${summary[@]}"; exit 1; }
python -c "from pycomm import _C; assert _C.cuda_built(), 'built without CUDA'; print('cuda_built')" \
  2>&1 | tee -a "$out/build.log"
grep -E "Compiling entry|registers|spill" "$out/build.log" | sed 's/^ *//' >"$out/ptxas.txt"
echo "kernels: $(grep -c 'Compiling entry' "$out/ptxas.txt"); with spills: \
$(grep -c -E '[1-9][0-9]* bytes spill stores' "$out/ptxas.txt")" | tee -a "$out/env.txt"

# Two ranks, one all_reduce each way the CUDA path is entered: a quick yes or no before
# the suite (a hang here would otherwise eat the suite's whole limit).
stage smoke 90 python -c "
from pycomm.testing import run_ranks
from tests import _cuda_scenarios as sc
print(run_ranks(sc.fast_paths_take_the_cuda_path, 2, timeout_s=60))"

stage tests "${GPU_CHECK_TESTS_S:-240}" python -m pytest -q -rfE -p no:cacheprovider \
  --timeout=100 -m gpu --junitxml="$out/tests.xml" \
  tests/test_cuda_collectives.py tests/test_fused_ops_cuda.py tests/test_offload_records.py

stage bench "${GPU_CHECK_BENCH_S:-110}" python -m bench.gpu_collectives --nproc 2 \
  --json "$out/gpu_collectives.json"

if [ "${GPU_CHECK_SANITIZER:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  stage memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_ops_cuda.py
fi

echo "== summary"
cat "$out/env.txt"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
