#include "tensor_args.h"

#include <c10/util/Exception.h>

#include "../core/errors.h"
#include "../core/reduce.h"

namespace pycomm_torch {
namespace {

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
  TORCH_CHECK_VALUE(t.device().is_cpu(), who(op, rank), ": got a tensor on ", t.device(),
                    "; this path takes CPU tensors only (CUDA tensors need a CUDA build of "
                    "pycomm._C and every rank of the group on one host)");
  return dense_dtype(t, op, rank);
}

pycomm::DType dense_dtype(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined(), who(op, rank), ": got an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, who(op, rank), ": got a ", t.layout(),
                    " tensor; only dense (strided) tensors are supported");
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
      auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
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
  TORCH_CHECK_VALUE(big.numel() == factor * small.numel(), who(op, rank), ": ", big_name, " ",
                    shape_str(big), " must have ", factor, " x the elements of ", small_name, " ",
                    shape_str(small), " (world size ", factor, ")");
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

}  // namespace pycomm_torch
