#include "torch/fused/fused.h"

#include <ATen/Parallel.h>

#include "recompute/fused_ops.h"
#include "torch/fused/fused_checks.h"

namespace pycomm_torch {
namespace {

// Elements per task: below this a tensor runs on the calling thread alone.
constexpr int64_t kGrain = int64_t(1) << 15;

pycomm::FusedDType fused_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": CPU tensors only here, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": tensors must be contiguous");
  if (t.scalar_type() == at::kFloat) return pycomm::FusedDType::F32;
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only, got ",
                    t.scalar_type());
  return pycomm::FusedDType::BF16;
}

template <typename F>
void over_elements(const at::Tensor& t, F&& fn) {
  at::parallel_for(0, t.numel(), kGrain, [&](int64_t begin, int64_t end) {
    fn(static_cast<size_t>(begin), static_cast<size_t>(end));
  });
}

}  // namespace

at::Tensor fused_bias_gelu(const at::Tensor& x, const at::Tensor& bias) {
  const char* op = "fused_bias_gelu";
  auto dt = fused_dtype(x, op);
  size_t cols = checked_cols(x, bias, op);
  at::Tensor y = at::empty_like(x);
  over_elements(x, [&](size_t b, size_t e) {
    pycomm::bias_gelu_forward(dt, y.data_ptr(), x.data_ptr(), bias.data_ptr(), b, e, cols);
  });
  return y;
}

at::Tensor fused_bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x,
                                    const at::Tensor& bias) {
  const char* op = "fused_bias_gelu_backward";
  auto dt = fused_dtype(x, op);
  check_like(x, grad, op, "the gradient");
  size_t cols = checked_cols(x, bias, op);
  at::Tensor gx = at::empty_like(x);
  over_elements(x, [&](size_t b, size_t e) {
    pycomm::bias_gelu_backward(dt, gx.data_ptr(), grad.data_ptr(), x.data_ptr(), bias.data_ptr(), b,
                               e, cols);
  });
  return gx;
}

at::Tensor fused_bias_dropout_add(const at::Tensor& x, const at::Tensor& bias,
                                  const at::Tensor& residual, double p, int64_t seed) {
  const char* op = "fused_bias_dropout_add";
  auto dt = fused_dtype(x, op);
  check_like(x, residual, op, "the residual");
  size_t cols = checked_cols(x, bias, op);
  check_p(p, op);
  at::Tensor y = at::empty_like(x);
  over_elements(x, [&](size_t b, size_t e) {
    pycomm::bias_dropout_add_forward(dt, y.data_ptr(), x.data_ptr(), bias.data_ptr(),
                                     residual.data_ptr(), static_cast<float>(p),
                                     static_cast<uint64_t>(seed), b, e, cols);
  });
  return y;
}

at::Tensor fused_dropout_backward(const at::Tensor& grad, double p, int64_t seed) {
  const char* op = "fused_dropout_backward";
  auto dt = fused_dtype(grad, op);
  check_p(p, op);
  at::Tensor gx = at::empty_like(grad);
  over_elements(grad, [&](size_t b, size_t e) {
    pycomm::dropout_backward(dt, gx.data_ptr(), grad.data_ptr(), static_cast<float>(p),
                             static_cast<uint64_t>(seed), b, e);
  });
  return gx;
}

}  // namespace pycomm_torch
