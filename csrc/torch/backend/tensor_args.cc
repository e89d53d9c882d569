#include "torch/backend/tensor_args.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include "core/base/errors.h"
#include "core/kernels/reduce.h"

namespace pycomm_torch {
namespace {

// PREMUL_SUM's factor: c10d::PreMulSumSupplement from torch 2.13 on, before that under
// its older name (which 2.13 keeps as an alias).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using PreMulSumFactor = c10d::NCCLPreMulSumSupplement;
#else
using PreMulSumFactor = c10d::PreMulSumSupplement;
#endif

std::string who(const char* op, int rank) {
  return std::string("pycomm: ") + op + " on rank " + std::to_string(rank);
}

}  // namespace

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

at::Tensor single(const std::vector<at::Tensor>& tensors, const char* op, int rank) {
  TORCH_CHECK_VALUE(tensors.size() == 1, who(op, rank), " takes exactly one tensor per rank, got ",
                    tensors.size());
  return tensors[0];
}

pycomm::DType checked_dtype(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined(), who(op, rank), ": got an undefined tensor");
#ifdef PYCOMM_CUDA
  TORCH_CHECK_VALUE(t.device().is_cpu(), who(op, rank), ": got a tensor on ", t.device(),
                    "; pycomm has no CUDA implementation of this op (CUDA tensors take "
                    "all_reduce, broadcast, reduce, all_gather, gather, scatter, "
                    "reduce_scatter and their tensor and coalesced forms); for the others "
                    "use init_process_group(\"cpu:pycomm,cuda:nccl\")");
#else
  TORCH_CHECK_VALUE(t.device().is_cpu(), who(op, rank), ": got a tensor on ", t.device(),
                    "; this path takes CPU tensors only (CUDA tensors need a CUDA build of "
                    "pycomm._C and every rank of the group on one host)");
#endif
  return dense_dtype(t, op, rank);
}

int64_t checked_mul(int64_t a, int64_t b, const char* op, int rank, const char* what) {
  int64_t out = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &out), who(op, rank), ": ", what, " (", a, " x ",
                    b, ") overflows a 64-bit size");
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const char* op, int rank, const char* what) {
  int64_t out = 0;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &out), who(op, rank), ": ", what, " (", a, " + ",
                    b, ") overflows a 64-bit size");
  return out;
}

pycomm::DType dense_dtype(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined(), who(op, rank), ": got an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, who(op, rank), ": got a ", t.layout(),
                    " tensor; only dense (strided) tensors are supported");
  // Every op's byte counts start from numel x element size: an expanded (stride 0)
  // tensor can claim more elements than memory holds.
  checked_mul(t.numel(), static_cast<int64_t>(t.element_size()), op, rank,
              "the tensor's size in bytes");
  switch (t.scalar_type()) {
    case at::kFloat:
      return pycomm::DType::F32;
    case at::kDouble:
      return pycomm::DType::F64;
    case at::kHalf:
      return pycomm::DType::F16;
    case at::kBFloat16:
      return pycomm::DType::BF16;
    case at::kChar:
      return pycomm::DType::I8;
    case at::kByte:
      return pycomm::DType::U8;
    case at::kInt:
      return pycomm::DType::I32;
    case at::kLong:
      return pycomm::DType::I64;
    case at::kBool:
      return pycomm::DType::BOOL;
    default:
      TORCH_CHECK_VALUE(false, who(op, rank), ": unsupported dtype ", t.scalar_type(),
                        " (supported: float32, float64, float16, bfloat16, int8, uint8, int32, "
                        "int64, bool)");
  }
}

ReduceSpec reduce_spec(const c10d::ReduceOp& op, pycomm::DType dtype, const char* what, int rank) {
  ReduceSpec s;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      s.op = pycomm::RedOp::SUM;
      break;
    case c10d::ReduceOp::AVG:
      s.op = pycomm::RedOp::AVG;
      break;
    case c10d::ReduceOp::PRODUCT:
      s.op = pycomm::RedOp::PROD;
      break;
    case c10d::ReduceOp::MIN:
      s.op = pycomm::RedOp::MIN;
      break;
    case c10d::ReduceOp::MAX:
      s.op = pycomm::RedOp::MAX;
      break;
    case c10d::ReduceOp::BAND:
      s.op = pycomm::RedOp::BAND;
      break;
    case c10d::ReduceOp::BOR:
      s.op = pycomm::RedOp::BOR;
      break;
    case c10d::ReduceOp::BXOR:
      s.op = pycomm::RedOp::BXOR;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_VALUE(pycomm::is_floating(dtype), who(what, rank),
                        ": PREMUL_SUM needs a floating tensor, got ", pycomm::dtype_name(dtype));
      auto* sup = dynamic_cast<PreMulSumFactor*>(op.supplement_.get());
      TORCH_CHECK_VALUE(sup != nullptr, who(what, rank), ": PREMUL_SUM without a factor");
      s.op = pycomm::RedOp::SUM;
      s.premul = true;
      s.factor =
          sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, who(what, rank), ": unsupported reduction op ",
                        static_cast<int>(op.op_));
  }
  try {
    pycomm::check_reduction(dtype, s.op);
  } catch (const pycomm::InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, who(what, rank), ": ", e.what());
  }
  return s;
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, int rank) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), who(op, rank),
                    ": input and output dtypes differ: ", a.scalar_type(), " vs ", b.scalar_type());
}

void check_numel_ratio(const at::Tensor& big, const at::Tensor& small, int64_t factor,
                       const char* op, const char* big_name, const char* small_name, int rank) {
  TORCH_CHECK_VALUE(big.numel() == checked_mul(factor, small.numel(), op, rank, small_name),
                    who(op, rank), ": ", big_name, " ", shape_str(big), " must have ", factor,
                    " x the elements of ", small_name, " ", shape_str(small), " (world size ",
                    factor, ")");
}

std::exception_ptr translate_current_exception() {
  try {
    throw;
  } catch (const pycomm::InvalidArgument& e) {
    try {
      TORCH_CHECK_VALUE(false, e.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (const pycomm::CommError& e) {
    try {
      C10_THROW_ERROR(DistBackendError, e.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return std::current_exception();
  }
  return std::current_exception();
}

std::exception_ptr translate_exception(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (...) {
    return translate_current_exception();
  }
}

void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, int64_t n,
                const char* op, const char* what, int rank) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(list.size()) == n, who(op, rank), ": ", what, " has ",
                    list.size(), " tensors, expected one per rank (", n, ")");
  for (const auto& t : list) {
    checked_dtype(t, op, rank);
    check_same_dtype(like, t, op, rank);
    TORCH_CHECK_VALUE(t.numel() == like.numel(), who(op, rank), ": ", what,
                      " holds a tensor of shape ", shape_str(t), " but the input has shape ",
                      shape_str(like));
  }
  check_total_bytes(list, op, rank);
}

bool check_gather_list(const std::vector<at::Tensor>& list, const at::Tensor& in, int64_t n,
                       const char* op, int rank) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(list.size()) == n, who(op, rank), ": the output list has ",
                    list.size(), " tensors, expected one per rank (", n, ")");
  bool uneven = false;
  for (const auto& t : list) {
    checked_dtype(t, op, rank);
    check_same_dtype(in, t, op, rank);
    uneven = uneven || t.numel() != in.numel();
  }
  check_total_bytes(list, op, rank);
  TORCH_CHECK_VALUE(list[rank].numel() == in.numel(), who(op, rank), ": output ", rank,
                    " (this rank's) has shape ", shape_str(list[rank]), " but the input has shape ",
                    shape_str(in));
  return uneven;
}

std::vector<at::Tensor> coalesced_gather_outputs(
    const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
    int64_t n, const char* op, int rank) {
  TORCH_CHECK_VALUE(!inputs.empty(), who(op, rank), ": got no input tensors");
  TORCH_CHECK_VALUE(static_cast<int64_t>(outputs.size()) == n, who(op, rank), ": got ",
                    outputs.size(), " output lists, expected one per rank (", n,
                    "): output_tensor_lists[r][i] receives rank r's input_tensor_list[i]");
  std::vector<at::Tensor> rank_major;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), who(op, rank), ": output list ", r,
                      " has ", outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      checked_dtype(o, op, rank);
      check_same_dtype(inputs[0], inputs[i], op, rank);
      check_same_dtype(inputs[i], o, op, rank);
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), who(op, rank), ": output ", r, "[", i,
                        "] has shape ", shape_str(o), " but input ", i, " has shape ",
                        shape_str(inputs[i]));
      rank_major.push_back(o);
    }
  }
  check_total_bytes(rank_major, op, rank);
  return rank_major;
}

void check_all_to_all_lists(const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& outputs, int n, const char* op,
                            int rank) {
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == n && static_cast<int>(outputs.size()) == n,
                    who(op, rank), ": needs ", n, " input and output tensors, got ", inputs.size(),
                    " and ", outputs.size());
  for (int i = 0; i < n; ++i) {
    checked_dtype(inputs[i], op, rank);
    checked_dtype(outputs[i], op, rank);
    check_same_dtype(inputs[0], inputs[i], op, rank);
    check_same_dtype(inputs[0], outputs[i], op, rank);
  }
  check_total_bytes(inputs, op, rank);
  check_total_bytes(outputs, op, rank);
}

std::vector<int64_t> split_elems(const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                                 const char* op, const char* which, int rank) {
  int64_t rows = t.dim() > 0 ? t.size(0) : 1;
  int64_t row_elems = rows > 0 ? t.numel() / rows : 0;
  std::vector<int64_t> c(n);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % n == 0, who(op, rank), ": ", which, " of shape ", shape_str(t),
                      " has ", rows, " rows, not divisible by the world size ", n,
                      "; pass split sizes");
    for (auto& x : c) x = rows / n * row_elems;
    return c;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == n, who(op, rank), ": ", which,
                    " split sizes have ", splits.size(), " entries, expected ", n);
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, who(op, rank), ": ", which, " split size ", i, " is ",
                      splits[i], ", negative");
    // Each split within the rows, and the running sum checked: a sum that wraps could
    // otherwise equal the row count and pass.
    TORCH_CHECK_VALUE(splits[i] <= rows, who(op, rank), ": ", which, " split size ", i, " is ",
                      splits[i], " rows but the tensor of shape ", shape_str(t), " has ", rows);
    total = checked_add(total, splits[i], op, rank, "the split sizes' sum");
    c[i] = splits[i] * row_elems;  // <= numel: within range once splits[i] <= rows
  }
  TORCH_CHECK_VALUE(total == rows, who(op, rank), ": ", which, " split sizes add up to ", total,
                    " rows but the tensor has ", rows);
  return c;
}

int64_t total_numel(const std::vector<at::Tensor>& tensors, const char* op, int rank) {
  int64_t total = 0;
  for (const auto& t : tensors)
    total = checked_add(total, t.numel(), op, rank, "the tensors' elements");
  return total;
}

void check_total_bytes(const std::vector<at::Tensor>& tensors, const char* op, int rank) {
  if (tensors.empty()) return;
  checked_mul(total_numel(tensors, op, rank), static_cast<int64_t>(tensors[0].element_size()), op,
              rank, "the tensors' size in bytes");
}

at::Tensor flat_copy(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) views.push_back(t.reshape({-1}));
  return at::cat(views);
}

void unflatten_into(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t off = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

at::Tensor as_bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

}  // namespace pycomm_torch
