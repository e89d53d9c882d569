// Turning torch tensors and c10d options into core arguments, with eager checks whose
// errors name the op, the rank and what was wrong.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

#include "core/base/types.h"

namespace pycomm_torch {

struct ReduceSpec {
  pycomm::RedOp op = pycomm::RedOp::SUM;
  bool premul = false;  // PREMUL_SUM: scale the input by `factor`, then SUM
  double factor = 1.0;

  // PREMUL_SUM's scaling of a buffer the op owns or overwrites anyway (a staged or flat
  // copy, an in-place all_reduce's tensor).
  void scale_owned(at::Tensor& owned) const {
    if (premul) owned.mul_(factor);
  }
  // What a reduction sends of a user's input: a scaled copy for PREMUL_SUM (the input
  // itself must stay as it was), else the input, contiguous.
  at::Tensor input_of(const at::Tensor& t) const {
    return premul ? t.mul(factor).contiguous() : t.contiguous();
  }
};

// The one tensor of a single-device op; anything else is a ValueError.
at::Tensor single(const std::vector<at::Tensor>& tensors, const char* op, int rank);
// CPU, dense, a supported dtype: its core dtype. Otherwise a ValueError naming it.
pycomm::DType checked_dtype(const at::Tensor& t, const char* op, int rank);
// The same checks without the device (the CUDA path checks that itself).
pycomm::DType dense_dtype(const at::Tensor& t, const char* op, int rank);
ReduceSpec reduce_spec(const c10d::ReduceOp& op, pycomm::DType dtype, const char* what, int rank);
void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, int rank);
// numel(big) == factor * numel(small), or a ValueError with both shapes.
void check_numel_ratio(const at::Tensor& big, const at::Tensor& small, int64_t factor,
                       const char* op, const char* big_name, const char* small_name, int rank);
std::string shape_str(const at::Tensor& t);
// a * b and a + b, or a ValueError naming the op and `what` when they overflow int64
// (sizes from the user's tensors and split lists are untrusted).
int64_t checked_mul(int64_t a, int64_t b, const char* op, int rank, const char* what);
int64_t checked_add(int64_t a, int64_t b, const char* op, int rank, const char* what);
// The elements of all `tensors` together, checked.
int64_t total_numel(const std::vector<at::Tensor>& tensors, const char* op, int rank);
// The flat buffer of all `tensors` (one dtype) has a size in bytes that fits int64.
void check_total_bytes(const std::vector<at::Tensor>& tensors, const char* op, int rank);

// `n` tensors (one per rank) like `like`: CPU, its dtype, its number of elements.
void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, int64_t n,
                const char* op, const char* what, int rank);
// all_gather's output list: `n` tensors of the input's dtype, this rank's the input's
// size. Returns whether the sizes differ between ranks (torch allows that).
bool check_gather_list(const std::vector<at::Tensor>& list, const at::Tensor& in, int64_t n,
                       const char* op, int rank);
// all_gather_coalesced's lists, in torch's layout: `outputs[r][i]` receives rank r's
// `inputs[i]` (n lists of inputs.size() tensors). Checks them and returns the outputs in
// rank-major order, the order of the inputs gathered flat.
std::vector<at::Tensor> coalesced_gather_outputs(
    const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
    int64_t n, const char* op, int rank);
// all_to_all's lists: `n` inputs and `n` outputs, CPU, all of the first input's dtype.
void check_all_to_all_lists(const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& outputs, int n, const char* op,
                            int rank);
// all_to_all_single: the elements of each peer's block of `t`, from split sizes in rows
// (dim 0; empty: equal splits). `which` names the tensor ("input", "output").
std::vector<int64_t> split_elems(const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                                 const char* op, const char* which, int rank);

// Flattens `tensors` (same dtype) into one new contiguous buffer.
at::Tensor flat_copy(const std::vector<at::Tensor>& tensors);
// Copies consecutive slices of `flat` back into `tensors`.
void unflatten_into(const at::Tensor& flat, std::vector<at::Tensor>& tensors);
// A contiguous tensor's bytes as a flat uint8 tensor: data movement is dtype-blind, so
// an engine sees one dtype it surely supports.
at::Tensor as_bytes(const at::Tensor& t);

// A contiguous stand-in for a tensor an op writes: the tensor itself when it is already
// contiguous, else a contiguous copy that commit() writes back.
class Staged {
 public:
  explicit Staged(const at::Tensor& t) : target_(t), buf_(t.is_contiguous() ? t : t.contiguous()) {}
  at::Tensor& get() { return buf_; }
  void* ptr() { return buf_.data_ptr(); }
  size_t numel() const { return static_cast<size_t>(buf_.numel()); }
  void commit() {
    if (!buf_.is_same(target_)) target_.copy_(buf_);
  }

 private:
  at::Tensor target_;
  at::Tensor buf_;
};

// Re-throws the current exception as what torch's Python layer expects:
// core InvalidArgument -> ValueError, CommError -> DistBackendError.
std::exception_ptr translate_current_exception();
std::exception_ptr translate_exception(std::exception_ptr error);
// Calls fn, translating core exceptions the same way (for the caller's thread).
template <class F>
auto translated(F fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (...) {
    std::rethrow_exception(translate_current_exception());
  }
}

}  // namespace pycomm_torch
