// CUDA versions of the fused recompute kernels (csrc/core/fused_ops.h): bias + GeLU,
// and bias + dropout + add, torch-free.
//
// Each works on all n elements of a contiguous row-major (n / cols, cols) tensor whose
// bias has `cols` elements, computes in float registers, and is enqueued on `stream`.
// As on CPU the forward keeps nothing: the backward recomputes x + bias (and the dropout
// mask) inside the gradient kernel. The mask is the CPU's, bit for bit: element i is kept
// when splitmix64(seed ^ splitmix64(i)) >> 32 >= p * (2^32 - 1), so a seed drawn once
// replays it on either device. Every function returns the launch's error (cudaSuccess
// when n is 0 and nothing is launched).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pycomm {
namespace cuda {

enum class FusedDType { F32, BF16, F16 };

// y = gelu(x + b) (exact, erf-based, as torch.nn.functional.gelu).
cudaError_t bias_gelu_forward(FusedDType t, void* y, const void* x, const void* b, size_t n,
                              size_t cols, cudaStream_t stream);
// gx = g * gelu'(x + b)
cudaError_t bias_gelu_backward(FusedDType t, void* gx, const void* g, const void* x, const void* b,
                               size_t n, size_t cols, cudaStream_t stream);
// y = dropout(x + b, p, seed) + residual; p = 0 adds without dropping.
cudaError_t bias_dropout_add_forward(FusedDType t, void* y, const void* x, const void* b,
                                     const void* residual, float p, uint64_t seed, size_t n,
                                     size_t cols, cudaStream_t stream);
// gx = g * mask(seed) / (1 - p)  (the gradient of the residual is g itself)
cudaError_t dropout_backward(FusedDType t, void* gx, const void* g, float p, uint64_t seed,
                             size_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
