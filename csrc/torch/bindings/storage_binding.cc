#include "torch/bindings/storage_binding.h"

#include <c10/core/StorageImpl.h>

namespace pycomm_torch {

namespace {

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "bind_storage: ", what, " must be a CPU tensor, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "bind_storage: ", what, " must be contiguous");
}

}  // namespace

at::Tensor unbound_tensor(const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

void bind_storage(const at::Tensor& target, const at::Tensor& source) {
  check_cpu_contiguous(target, "the target");
  check_cpu_contiguous(source, "the source");
  TORCH_CHECK_VALUE(target.storage_offset() == 0,
                    "bind_storage: the target must start its storage");
  TORCH_CHECK_VALUE(target.scalar_type() == source.scalar_type(), "bind_storage: dtypes differ (",
                    target.scalar_type(), " vs ", source.scalar_type(), ")");
  TORCH_CHECK_VALUE(bytes_of(source) >= bytes_of(target), "bind_storage: source holds ",
                    bytes_of(source), " bytes, the target needs ", bytes_of(target));
  // The DataPtr's context is a reference to the source's storage: the arena slot cannot
  // be freed while a parameter (or a view autograd saved) still points into it.
  auto* keep = new c10::Storage(source.storage());
  c10::DataPtr data(
      source.data_ptr(), keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, at::kCPU);
  c10::StorageImpl* impl = target.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(std::move(data));
  impl->set_nbytes(bytes_of(source));
}

void unbind_storage(const at::Tensor& target) {
  c10::StorageImpl* impl = target.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, at::kCPU));
  impl->set_nbytes(0);
}

}  // namespace pycomm_torch
