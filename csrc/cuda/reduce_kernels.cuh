// Copy-reduce kernels for the CUDA path: dst[d][i] = scale * (src[0][i] op ... op
// src[k-1][i]) for up to kMaxSources sources (local or a peer's window over CUDA IPC) and
// up to kMaxDests destinations at once, with 16-byte vector loads and stores where every
// pointer is 16-byte aligned. Torch-free: dtypes and ops are the core's (types.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/base/types.h"

namespace pycomm {
namespace cuda {

constexpr int kMaxSources = 8;
constexpr int kMaxDests = 2;

// Whether `op` on `t` has a kernel (SUM/PROD/MIN/MAX on float32, float64, float16,
// bfloat16, int32, int64; AVG is SUM with scale = 1/n). Copies (one source) take any dtype.
bool reduce_supported(DType t, RedOp op);

// Launches on `stream`. `scale` applies to floating types (1 = none); 16-bit floats
// accumulate in float32 and round once. dst may alias a source only elementwise (in
// place). Returns the launch error, if any.
cudaError_t copy_reduce(DType t, RedOp op, void* const* dsts, int ndst, const void* const* srcs,
                        int nsrc, size_t n, float scale, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
