// Fused element-wise kernels for recomputation: bias + GeLU, and bias + dropout + add.
//
// Each works on elements [begin, end) of a row-major (rows, cols) tensor whose bias has
// `cols` elements, so callers can split the range across threads. The forward keeps no
// intermediate: the backward recomputes the activation (GeLU's input, the dropout mask)
// in the same pass that computes the gradient. Dropout masks come from a counter-based
// hash of (seed, element index), so a seed alone replays them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pycomm {

enum class FusedDType { F32, BF16 };

// y = gelu(x + b) (exact, erf-based, as torch.nn.functional.gelu).
void bias_gelu_forward(FusedDType t, void* y, const void* x, const void* b, size_t begin,
                       size_t end, size_t cols);
// gx = g * gelu'(x + b)
void bias_gelu_backward(FusedDType t, void* gx, const void* g, const void* x, const void* b,
                        size_t begin, size_t end, size_t cols);
// y = dropout(x + b, p, seed) + residual; p = 0 adds without dropping.
void bias_dropout_add_forward(FusedDType t, void* y, const void* x, const void* b,
                              const void* residual, float p, uint64_t seed, size_t begin,
                              size_t end, size_t cols);
// gx = g * mask(seed) / (1 - p)  (the gradient of the residual is g itself)
void dropout_backward(FusedDType t, void* gx, const void* g, float p, uint64_t seed, size_t begin,
                      size_t end);
// Whether element i is kept (exposed for tests of the mask's statistics).
bool dropout_keeps(uint64_t seed, size_t i, float p);

}  // namespace pycomm
