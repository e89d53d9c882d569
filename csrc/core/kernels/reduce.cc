// Reduction kernels. Each public entry switches on dtype and op once, outside the loop,
// and the loops are plain enough for GCC to vectorise. target_clones builds AVX-512,
// AVX2 and baseline copies of each kernel and picks one at load time, so one wheel is
// fast on every x86-64 machine. float16 goes through reduce_copy's F16C path where the
// CPU has it (f16c.h), so every float16 kernel of a process converts one way.
#include "core/kernels/reduce.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "core/base/errors.h"
#include "core/kernels/element_ops.h"
#include "core/kernels/f16c.h"
#include "core/kernels/float16.h"
#include "core/kernels/kernel_attrs.h"

namespace pycomm {
namespace {

// ---- element ops --------------------------------------------------------------------

template <typename T>
struct Arith {  // T is the computing type (float, double, or an unsigned int for wraparound)
  static PYCOMM_INLINE T sum(T a, T b) { return static_cast<T>(a + b); }
  static PYCOMM_INLINE T prod(T a, T b) { return static_cast<T>(a * b); }
  static PYCOMM_INLINE T min(T a, T b) { return nan_wins(a, b, b < a ? b : a); }
  static PYCOMM_INLINE T max(T a, T b) { return nan_wins(a, b, a < b ? b : a); }
};

// One loop per (op), all written the same way: load, combine, scale, store.
#define PYCOMM_PAIR_LOOP(LOAD, STORE, COMBINE) \
  for (size_t i = 0; i < n; ++i) {             \
    auto x = LOAD(a[i]);                       \
    auto y = LOAD(b[i]);                       \
    dst[i] = STORE(COMBINE(x, y));             \
  }

#define PYCOMM_FLOAT_PAIR_KERNEL(NAME, T, C, LOAD, STORE)                            \
  PYCOMM_CLONES void NAME(RedOp op, T* dst, const T* a, const T* b, size_t n, C s) { \
    using A = Arith<C>;                                                              \
    if (s != C(1)) {                                                                 \
      switch (op) {                                                                  \
        case RedOp::SUM:                                                             \
          PYCOMM_PAIR_LOOP(LOAD, STORE, s * A::sum);                                 \
          return;                                                                    \
        default:                                                                     \
          break;                                                                     \
      }                                                                              \
    }                                                                                \
    switch (op) {                                                                    \
      case RedOp::SUM:                                                               \
        PYCOMM_PAIR_LOOP(LOAD, STORE, A::sum);                                       \
        return;                                                                      \
      case RedOp::PROD:                                                              \
        PYCOMM_PAIR_LOOP(LOAD, STORE, A::prod);                                      \
        return;                                                                      \
      case RedOp::MIN:                                                               \
        PYCOMM_PAIR_LOOP(LOAD, STORE, A::min);                                       \
        return;                                                                      \
      case RedOp::MAX:                                                               \
        PYCOMM_PAIR_LOOP(LOAD, STORE, A::max);                                       \
        return;                                                                      \
      default:                                                                       \
        return;                                                                      \
    }                                                                                \
  }

#define PYCOMM_ID(x) (x)
PYCOMM_FLOAT_PAIR_KERNEL(pair_f32, float, float, PYCOMM_ID, PYCOMM_ID)
PYCOMM_FLOAT_PAIR_KERNEL(pair_f64, double, double, PYCOMM_ID, PYCOMM_ID)
PYCOMM_FLOAT_PAIR_KERNEL(pair_bf16, uint16_t, float, bf16_to_float, float_to_bf16)
PYCOMM_FLOAT_PAIR_KERNEL(pair_f16, uint16_t, float, f16_to_float, float_to_f16)

// Integers compute in the unsigned type of the same width: wraparound, no UB.
template <typename U>
PYCOMM_INLINE U band(U a, U b) {
  return a & b;
}
template <typename U>
PYCOMM_INLINE U bor(U a, U b) {
  return a | b;
}
template <typename U>
PYCOMM_INLINE U bxor(U a, U b) {
  return a ^ b;
}

#define PYCOMM_INT_PAIR_KERNEL(NAME, S, U)                                              \
  PYCOMM_CLONES void NAME(RedOp op, S* sdst, const S* sa, const S* sb, size_t n) {      \
    auto* dst = reinterpret_cast<U*>(sdst);                                             \
    auto* a = reinterpret_cast<const U*>(sa);                                           \
    auto* b = reinterpret_cast<const U*>(sb);                                           \
    using A = Arith<U>;                                                                 \
    auto smin = [](U x, U y) { return static_cast<S>(y) < static_cast<S>(x) ? y : x; }; \
    auto smax = [](U x, U y) { return static_cast<S>(x) < static_cast<S>(y) ? y : x; }; \
    switch (op) {                                                                       \
      case RedOp::SUM:                                                                  \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, A::sum);                                 \
        return;                                                                         \
      case RedOp::PROD:                                                                 \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, A::prod);                                \
        return;                                                                         \
      case RedOp::MIN:                                                                  \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, smin);                                   \
        return;                                                                         \
      case RedOp::MAX:                                                                  \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, smax);                                   \
        return;                                                                         \
      case RedOp::BAND:                                                                 \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, band<U>);                                \
        return;                                                                         \
      case RedOp::BOR:                                                                  \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, bor<U>);                                 \
        return;                                                                         \
      case RedOp::BXOR:                                                                 \
        PYCOMM_PAIR_LOOP(PYCOMM_ID, PYCOMM_ID, bxor<U>);                                \
        return;                                                                         \
      default:                                                                          \
        return;                                                                         \
    }                                                                                   \
  }

PYCOMM_INT_PAIR_KERNEL(pair_i8, int8_t, uint8_t)
PYCOMM_INT_PAIR_KERNEL(pair_u8, uint8_t, uint8_t)
PYCOMM_INT_PAIR_KERNEL(pair_i32, int32_t, uint32_t)
PYCOMM_INT_PAIR_KERNEL(pair_i64, int64_t, uint64_t)

PYCOMM_CLONES void scale_f32(float* dst, const float* src, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) dst[i] = s * src[i];
}
PYCOMM_CLONES void scale_f64(double* dst, const double* src, size_t n, double s) {
  for (size_t i = 0; i < n; ++i) dst[i] = s * src[i];
}
PYCOMM_CLONES void scale_bf16(uint16_t* dst, const uint16_t* src, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(s * bf16_to_float(src[i]));
}
PYCOMM_CLONES void scale_f16(uint16_t* dst, const uint16_t* src, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_f16(s * f16_to_float(src[i]));
}

template <typename T>
const T* as(const void* p) {
  return static_cast<const T*>(p);
}
template <typename T>
T* as(void* p) {
  return static_cast<T*>(p);
}

}  // namespace

void check_reduction(DType t, RedOp op) {
  bool bitwise = op == RedOp::BAND || op == RedOp::BOR || op == RedOp::BXOR;
  if (is_floating(t) && bitwise) {
    throw InvalidArgument(std::string("pycomm: reduction op ") + redop_name(op) +
                          " is not defined for " + dtype_name(t) +
                          " (bitwise ops need an integer or bool tensor)");
  }
  if (!is_floating(t) && op == RedOp::AVG) {
    throw InvalidArgument(std::string("pycomm: reduction op AVG is not supported for ") +
                          dtype_name(t) + " (use SUM and divide, or a floating dtype)");
  }
  if (op == RedOp::NONE) throw InvalidArgument("pycomm: missing reduction op");
}

RedOp kernel_op(DType t, RedOp op) {
  if (op == RedOp::AVG) return RedOp::SUM;
  if (t != DType::BOOL) return op;
  switch (op) {
    case RedOp::SUM:
    case RedOp::MAX:
    case RedOp::BOR:
      return RedOp::MAX;  // 0/1 values: max is logical or
    case RedOp::PROD:
    case RedOp::MIN:
    case RedOp::BAND:
      return RedOp::MIN;  // min is logical and
    default:
      return op;
  }
}

void reduce_pair(DType t, RedOp op, void* dst, const void* a, const void* b, size_t n,
                 double scale) {
  switch (t) {
    case DType::F32:
      return pair_f32(op, as<float>(dst), as<float>(a), as<float>(b), n, float(scale));
    case DType::F64:
      return pair_f64(op, as<double>(dst), as<double>(a), as<double>(b), n, scale);
    case DType::BF16:
      return pair_bf16(op, as<uint16_t>(dst), as<uint16_t>(a), as<uint16_t>(b), n, float(scale));
    case DType::F16:
      if (f16c_supported()) {  // converted as reduce_copy does (f16c.h), one way per process
        const void* srcs[2] = {a, b};
        return reduce_copy(t, op, &dst, 1, srcs, 2, n, scale);
      }
      return pair_f16(op, as<uint16_t>(dst), as<uint16_t>(a), as<uint16_t>(b), n, float(scale));
    case DType::I8:
      return pair_i8(op, as<int8_t>(dst), as<int8_t>(a), as<int8_t>(b), n);
    case DType::U8:
    case DType::BOOL:
      return pair_u8(op, as<uint8_t>(dst), as<uint8_t>(a), as<uint8_t>(b), n);
    case DType::I32:
      return pair_i32(op, as<int32_t>(dst), as<int32_t>(a), as<int32_t>(b), n);
    case DType::I64:
      return pair_i64(op, as<int64_t>(dst), as<int64_t>(a), as<int64_t>(b), n);
  }
}

void reduce_many(DType t, RedOp op, void* dst, const void* const* srcs, int k, size_t n,
                 double scale) {
  if (k == 1) {
    if (dst != srcs[0]) std::memcpy(dst, srcs[0], n * dtype_size(t));
    if (scale != 1.0) scale_copy(t, dst, dst, n, scale);
    return;
  }
  // Two wide sources: the pair loop streams straight from both into dst. Otherwise one
  // pass through an L1 accumulator (16-bit floats must accumulate in float32 anyway).
  bool wide = t != DType::BF16 && t != DType::F16;
  if (k == 2 && wide) return reduce_pair(t, op, dst, srcs[0], srcs[1], n, scale);
  reduce_copy(t, op, &dst, 1, srcs, k, n, scale);
}

void scale_copy(DType t, void* dst, const void* src, size_t n, double scale) {
  switch (t) {
    case DType::F32:
      return scale_f32(as<float>(dst), as<float>(src), n, float(scale));
    case DType::F64:
      return scale_f64(as<double>(dst), as<double>(src), n, scale);
    case DType::BF16:
      return scale_bf16(as<uint16_t>(dst), as<uint16_t>(src), n, float(scale));
    case DType::F16:
      if (f16c_supported()) return reduce_copy(t, RedOp::SUM, &dst, 1, &src, 1, n, scale);
      return scale_f16(as<uint16_t>(dst), as<uint16_t>(src), n, float(scale));
    default:
      if (dst != src) std::memcpy(dst, src, n * dtype_size(t));
  }
}

// Chosen the way the kernels' copies are (GCC function multiversioning over the same
// targets as PYCOMM_CLONES), so this names the copy the loader picked for them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
namespace {
__attribute__((target("default"))) const char* isa_of_clone() { return "x86-64 (SSE2)"; }
__attribute__((target("arch=x86-64-v3"))) const char* isa_of_clone() { return "x86-64-v3 (AVX2)"; }
__attribute__((target("arch=x86-64-v4"))) const char* isa_of_clone() {
  return "x86-64-v4 (AVX-512)";
}
}  // namespace
const char* kernel_isa() { return isa_of_clone(); }
#else
const char* kernel_isa() { return "portable"; }
#endif

}  // namespace pycomm
