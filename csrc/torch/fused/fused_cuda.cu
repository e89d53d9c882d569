// torch glue of the CUDA fused recompute kernels (csrc/cuda/fused_kernels): the checks
// of fused.cc, the device of the input and the caller's current stream. Compiled in CUDA
// builds only, where module.cc registers these as pycomm._C.fused_*_cuda.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/fused_kernels.cuh"
#include "torch/fused/fused.h"
#include "torch/fused/fused_checks.h"

namespace py = pybind11;

namespace pycomm_torch {
namespace {

using pycomm::cuda::FusedDType;

FusedDType cuda_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.is_cuda(), op, ": CUDA tensors only here, got ", x.device());
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": tensors must be contiguous");
  switch (x.scalar_type()) {
    case at::kFloat:
      return FusedDType::F32;
    case at::kBFloat16:
      return FusedDType::BF16;
    case at::kHalf:
      return FusedDType::F16;
    default:
      TORCH_CHECK_VALUE(false, op, ": float32, bfloat16 or float16 only, got ", x.scalar_type());
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor fused_bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias) {
  const char* op = "fused_bias_gelu";
  auto dt = cuda_dtype(x, op);
  size_t cols = checked_cols(x, bias, op);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_launch(pycomm::cuda::bias_gelu_forward(dt, y.data_ptr(), x.data_ptr(), bias.data_ptr(),
                                               x.numel(), cols, c10::cuda::getCurrentCUDAStream()),
               op);
  return y;
}

at::Tensor fused_bias_gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                         const at::Tensor& bias) {
  const char* op = "fused_bias_gelu_backward";
  auto dt = cuda_dtype(x, op);
  check_like(x, grad, op, "the gradient");
  size_t cols = checked_cols(x, bias, op);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor gx = at::empty_like(x);
  check_launch(pycomm::cuda::bias_gelu_backward(dt, gx.data_ptr(), grad.data_ptr(), x.data_ptr(),
                                                bias.data_ptr(), x.numel(), cols,
                                                c10::cuda::getCurrentCUDAStream()),
               op);
  return gx;
}

at::Tensor fused_bias_dropout_add_cuda(const at::Tensor& x, const at::Tensor& bias,
                                       const at::Tensor& residual, double p, int64_t seed) {
  const char* op = "fused_bias_dropout_add";
  auto dt = cuda_dtype(x, op);
  check_like(x, residual, op, "the residual");
  size_t cols = checked_cols(x, bias, op);
  check_p(p, op);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_launch(pycomm::cuda::bias_dropout_add_forward(
                   dt, y.data_ptr(), x.data_ptr(), bias.data_ptr(), residual.data_ptr(),
                   static_cast<float>(p), static_cast<uint64_t>(seed), x.numel(), cols,
                   c10::cuda::getCurrentCUDAStream()),
               op);
  return y;
}

at::Tensor fused_dropout_backward_cuda(const at::Tensor& grad, double p, int64_t seed) {
  const char* op = "fused_dropout_backward";
  auto dt = cuda_dtype(grad, op);
  check_p(p, op);
  c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor gx = at::empty_like(grad);
  check_launch(pycomm::cuda::dropout_backward(dt, gx.data_ptr(), grad.data_ptr(),
                                              static_cast<float>(p), static_cast<uint64_t>(seed),
                                              grad.numel(), c10::cuda::getCurrentCUDAStream()),
               op);
  return gx;
}

}  // namespace

void register_fused_cuda(py::module_& m) {
  m.def("fused_bias_gelu_cuda", &fused_bias_gelu_cuda, py::arg("x"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>(), "gelu(x + bias), one kernel (CUDA tensors).");
  m.def("fused_bias_gelu_backward_cuda", &fused_bias_gelu_backward_cuda, py::arg("grad"),
        py::arg("x"), py::arg("bias"), py::call_guard<py::gil_scoped_release>(),
        "grad * gelu'(x + bias), recomputing x + bias in the same kernel (CUDA tensors).");
  m.def("fused_bias_dropout_add_cuda", &fused_bias_dropout_add_cuda, py::arg("x"), py::arg("bias"),
        py::arg("residual"), py::arg("p"), py::arg("seed"),
        py::call_guard<py::gil_scoped_release>(),
        "dropout(x + bias) + residual, the CPU's mask for the seed (CUDA tensors).");
  m.def("fused_dropout_backward_cuda", &fused_dropout_backward_cuda, py::arg("grad"), py::arg("p"),
        py::arg("seed"), py::call_guard<py::gil_scoped_release>(),
        "grad * mask(seed) / (1 - p), the mask recomputed from the seed (CUDA tensors).");
}

}  // namespace pycomm_torch
