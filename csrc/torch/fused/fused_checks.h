// Argument checks shared by the CPU (fused.cc) and CUDA (fused_cuda.cu) glue of the
// fused recompute ops; each side checks the input's device and dtype itself.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>

namespace pycomm_torch {

// `other` (the gradient, the residual) must be the input's twin: device, shape, dtype.
inline void check_like(const at::Tensor& x, const at::Tensor& other, const char* op,
                       const char* what) {
  TORCH_CHECK_VALUE(other.device() == x.device(), op, ": ", what, " is on ", other.device(),
                    ", the input on ", x.device());
  TORCH_CHECK_VALUE(other.sizes() == x.sizes() && other.scalar_type() == x.scalar_type(), op, ": ",
                    what, " is ", other.sizes(), " ", other.scalar_type(), ", the input ",
                    x.sizes(), " ", x.scalar_type());
  TORCH_CHECK_VALUE(other.is_contiguous(), op, ": tensors must be contiguous");
}

// The bias: one value per column of the input, on its device, of its dtype.
inline size_t checked_cols(const at::Tensor& x, const at::Tensor& bias, const char* op) {
  TORCH_CHECK_VALUE(bias.device() == x.device(), op, ": bias is on ", bias.device(),
                    ", the input on ", x.device());
  TORCH_CHECK_VALUE(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), op,
                    ": bias of shape ", bias.sizes(), " does not match the last dimension of ",
                    x.sizes());
  TORCH_CHECK_VALUE(bias.scalar_type() == x.scalar_type(), op, ": bias is ", bias.scalar_type(),
                    ", the input ", x.scalar_type());
  TORCH_CHECK_VALUE(bias.is_contiguous(), op, ": tensors must be contiguous");
  return static_cast<size_t>(bias.size(0));
}

inline void check_p(double p, const char* op) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, op, ": dropout probability must be in [0, 1), got ", p);
}

}  // namespace pycomm_torch
