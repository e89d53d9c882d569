#!/usr/bin/env bash
# The GPU check of the CUDA path, in one go (fits ~8 minutes on an H200): build with CUDA
# (registers and spills of every kernel from -Xptxas -v), the GPU tests, then the CUDA
# collectives and the copy-reduce kernel against the device's copy bandwidth. The table
# comes last. Needs a CUDA build of torch and nvcc; run from the repository root.
set -uo pipefail
out="${OUT:-/tmp/pycomm-gpu-check}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"

echo "== build (with -Xptxas -v)"
export PYCOMM_PTXAS_VERBOSE=1 PYCOMM_CUDA_ARCH="${PYCOMM_CUDA_ARCH:-90}"
time pip install --no-build-isolation -e . -v >"$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
python -c "from pycomm import _C; assert _C.cuda_built(), 'built without CUDA'"
grep -E "Compiling entry|registers|spill" "$out/build.log" | sed 's/^ *//' >"$out/ptxas.txt"
echo "kernels: $(grep -c 'Compiling entry' "$out/ptxas.txt"); with spills: $(grep -c -E '[1-9][0-9]* bytes spill stores' "$out/ptxas.txt")"

echo "== GPU tests"
timeout 300 python -m pytest -q -m gpu tests/test_cuda_collectives.py tests/test_fused_ops_cuda.py \
  2>&1 | tee "$out/tests.txt" | tail -15

echo "== CUDA collectives (pycomm vs NCCL) and the kernel vs copy bandwidth"
timeout 240 python -m bench.gpu_collectives --nproc 2 --json "$out/gpu_collectives.json" \
  2>&1 | tee "$out/bench.txt" | tail -20
