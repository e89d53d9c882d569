// torch glue of the fused recompute kernels (csrc/core/fused_ops): checks, threads.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace pycomm_torch {

at::Tensor fused_bias_gelu(const at::Tensor& x, const at::Tensor& bias);
at::Tensor fused_bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x,
                                    const at::Tensor& bias);
at::Tensor fused_bias_dropout_add(const at::Tensor& x, const at::Tensor& bias,
                                  const at::Tensor& residual, double p, int64_t seed);
at::Tensor fused_dropout_backward(const at::Tensor& grad, double p, int64_t seed);

// CUDA builds only (fused_cuda.cu): adds fused_*_cuda, the same ops on CUDA tensors with
// the kernels of csrc/cuda/fused_kernels.
void register_fused_cuda(pybind11::module_& m);

}  // namespace pycomm_torch
