#include "core/base/types.h"

namespace pycomm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
  }
  return 1;
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::F16 || t == DType::BF16;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
    case DType::I8:
      return "int8";
    case DType::U8:
      return "uint8";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::BOOL:
      return "bool";
  }
  return "?";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::SUM:
      return "SUM";
    case RedOp::AVG:
      return "AVG";
    case RedOp::PROD:
      return "PRODUCT";
    case RedOp::MIN:
      return "MIN";
    case RedOp::MAX:
      return "MAX";
    case RedOp::BAND:
      return "BAND";
    case RedOp::BOR:
      return "BOR";
    case RedOp::BXOR:
      return "BXOR";
    case RedOp::NONE:
      return "";
  }
  return "?";
}

const char* opkind_name(OpKind k) {
  switch (k) {
    case OpKind::ALL_REDUCE:
      return "all_reduce";
    case OpKind::BROADCAST:
      return "broadcast";
    case OpKind::REDUCE:
      return "reduce";
    case OpKind::ALL_GATHER:
      return "all_gather";
    case OpKind::REDUCE_SCATTER:
      return "reduce_scatter";
    case OpKind::ALL_TO_ALL:
      return "all_to_all";
    case OpKind::GATHER:
      return "gather";
    case OpKind::SCATTER:
      return "scatter";
    case OpKind::BARRIER:
      return "barrier";
    case OpKind::SEND:
      return "send";
    case OpKind::ALL_TO_ALL_COUNTED:
      return "all_to_all_counted";
  }
  return "?";
}

std::string describe(const OpDesc& d) {
  std::string s = opkind_name(d.kind);
  if (d.kind == OpKind::BARRIER) return s;
  s += " ";
  s += dtype_name(d.dtype);
  if (d.kind != OpKind::ALL_TO_ALL) s += "[" + std::to_string(d.count) + "]";
  if (d.op != RedOp::NONE) s += std::string(" ") + redop_name(d.op);
  if (d.kind == OpKind::SEND) {
    s += " tag " + std::to_string(d.root);
  } else if (d.root >= 0) {
    s += " root " + std::to_string(d.root);
  }
  return s;
}

bool publishable(const OpDesc& d) {
  constexpr uint64_t kMostBytes = uint64_t{1} << 48;  // 256 TiB: beyond any host's memory
  uint64_t bytes = 0;
  return d.seq != 0 &&
         static_cast<uint32_t>(d.kind) <= static_cast<uint32_t>(OpKind::ALL_TO_ALL_COUNTED) &&
         static_cast<uint32_t>(d.dtype) <= static_cast<uint32_t>(DType::BOOL) &&
         static_cast<uint32_t>(d.op) <= static_cast<uint32_t>(RedOp::NONE) &&
         !__builtin_mul_overflow(d.count, dtype_size(d.dtype), &bytes) && bytes < kMostBytes;
}

std::string unpublishable(int peer, const char* word, const OpDesc& d) {
  return "pycomm: rank " + std::to_string(peer) + "'s " + word + " reads seq " +
         std::to_string(d.seq) + ", kind " + std::to_string(static_cast<uint32_t>(d.kind)) +
         ", dtype " + std::to_string(static_cast<uint32_t>(d.dtype)) + ", count " +
         std::to_string(d.count) + ", op " + std::to_string(static_cast<uint32_t>(d.op)) +
         ", which no pycomm rank publishes: the group's shared segment was written by "
         "something other than pycomm";
}

bool same_call(const OpDesc& a, const OpDesc& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == OpKind::BARRIER) return true;
  return a.dtype == b.dtype && a.count == b.count && a.op == b.op && a.root == b.root;
}

}  // namespace pycomm
