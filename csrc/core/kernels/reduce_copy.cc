// reduce_copy: one pass over any number of sources, the result stored to any number of
// destinations. A block of elements is combined in an L1-resident accumulator (in
// float32 for 16-bit floats, rounded once), so k sources cost one read each instead of
// the k - 1 passes of a pairwise fold, and a result wanted in several places (the
// zero-copy all_reduce pushes it to every rank) is stored there without being read back.
// With one or two destinations the last fold stores straight to them.
#include <cstdint>

#include "core/kernels/element_ops.h"
#include "core/kernels/f16c.h"
#include "core/kernels/float16.h"
#include "core/kernels/kernel_attrs.h"
#include "core/kernels/reduce.h"

namespace pycomm {
namespace {

// 512 elements: 2-4 KB of accumulator, well inside L1 next to the streams it reads.
constexpr size_t kBlock = 512;

// How an element is stored (S), computed (C), and ordered: integers compute in the
// unsigned type of their width (wraparound, no UB) and compare as the signed type.
template <typename S, typename C, typename Ordered>
struct Elem {
  using Store = S;
  using Compute = C;
  // Whether a loop that folds and stores in one goes vectorised (see reduce_copy_body).
  static constexpr bool kFusedStore = true;
  static PYCOMM_INLINE C load(S x) { return static_cast<C>(x); }
  static PYCOMM_INLINE S store(C x) { return static_cast<S>(x); }
  static PYCOMM_INLINE bool less(C a, C b) {
    return static_cast<Ordered>(a) < static_cast<Ordered>(b);
  }
};

struct Bf16Elem {
  using Store = uint16_t;
  using Compute = float;
  static constexpr bool kFusedStore = true;
  static PYCOMM_INLINE float load(uint16_t x) { return bf16_to_float(x); }
  static PYCOMM_INLINE uint16_t store(float x) { return float_to_bf16(x); }
  static PYCOMM_INLINE bool less(float a, float b) { return a < b; }
};

struct F16Elem {
  using Store = uint16_t;  // the half's bits (float16.h)
  using Compute = float;
  // Its rounding's selects inside a fold's loop kept GCC from vectorising it (2 sources,
  // 256 Ki elements: 511 us against 23 for bfloat16); a loop that only stores does.
  static constexpr bool kFusedStore = false;
  static PYCOMM_INLINE float load(uint16_t x) { return f16_to_float(x); }
  static PYCOMM_INLINE uint16_t store(float x) { return float_to_f16(x); }
  static PYCOMM_INLINE bool less(float a, float b) { return a < b; }
};

template <typename E>
struct Combine {
  using C = typename E::Compute;
  static PYCOMM_INLINE C sum(C a, C b) { return static_cast<C>(a + b); }
  static PYCOMM_INLINE C prod(C a, C b) { return static_cast<C>(a * b); }
  static PYCOMM_INLINE C min(C a, C b) { return nan_wins(a, b, E::less(b, a) ? b : a); }
  static PYCOMM_INLINE C max(C a, C b) { return nan_wins(a, b, E::less(a, b) ? b : a); }
  static PYCOMM_INLINE C band(C a, C b) { return static_cast<C>(a & b); }
  static PYCOMM_INLINE C bor(C a, C b) { return static_cast<C>(a | b); }
  static PYCOMM_INLINE C bxor(C a, C b) { return static_cast<C>(a ^ b); }
};

// Where a fold's results go: the accumulator (every fold but the last), or straight to
// the destinations (the last fold, when there are at most two of them).
template <typename E>
struct ToAcc {
  typename E::Compute* acc;
  PYCOMM_INLINE void operator()(size_t i, typename E::Compute v) const { acc[i] = v; }
};

// The last fold's result, scaled when asked (floating types only) and rounded once, stored
// to one or two destinations in the loop that computes it. Stored to the accumulator and
// copied out (which GCC made `rep movsq`), a 64 MB 2-rank zero-copy all_reduce, both of
// whose destinations are also sources, took 3.0 ms against 2.0 (AMD EPYC VM).
template <typename E, int ND, bool Scaled>
struct ToDsts {
  typename E::Store* d0;
  typename E::Store* d1;
  typename E::Compute scale;
  PYCOMM_INLINE void operator()(size_t i, typename E::Compute v) const {
    if constexpr (Scaled) v *= scale;
    d0[i] = E::store(v);
    if constexpr (ND == 2) d1[i] = E::store(v);
  }
};

// sink(i, first[i] op src[i]), where `first` is the accumulator or, for the first fold,
// the first source (so the first two sources are read in one loop). The switch is
// outside the loops so each loop vectorises.
template <typename E, typename First, typename Sink>
PYCOMM_INLINE void fold(RedOp op, const First* first, const typename E::Store* src, size_t m,
                        Sink sink) {
  using C = typename E::Compute;
  using F = Combine<E>;
  auto at = [first](size_t i) -> C {
    if constexpr (std::is_same_v<First, C>) {
      return first[i];
    } else {
      return E::load(first[i]);
    }
  };
#define PYCOMM_FOLD(FN) \
  for (size_t i = 0; i < m; ++i) sink(i, F::FN(at(i), E::load(src[i])));
  switch (op) {
    case RedOp::SUM:
      PYCOMM_FOLD(sum);
      return;
    case RedOp::PROD:
      PYCOMM_FOLD(prod);
      return;
    case RedOp::MIN:
      PYCOMM_FOLD(min);
      return;
    case RedOp::MAX:
      PYCOMM_FOLD(max);
      return;
    default:
      break;
  }
  if constexpr (std::is_integral_v<C>) {
    switch (op) {
      case RedOp::BAND:
        PYCOMM_FOLD(band);
        return;
      case RedOp::BOR:
        PYCOMM_FOLD(bor);
        return;
      case RedOp::BXOR:
        PYCOMM_FOLD(bxor);
        return;
      default:
        return;
    }
  }
#undef PYCOMM_FOLD
}

// body(sink) with the sink that stores to the nd <= 2 destinations at `base`, the scale
// applied (floating types) in the same loop.
template <typename E, typename Body>
PYCOMM_INLINE void into_dsts(typename E::Store* const* dsts, int nd, size_t base,
                             typename E::Compute scale, Body body) {
  using S = typename E::Store;
  S* d0 = dsts[0] + base;
  S* d1 = nd == 2 ? dsts[1] + base : nullptr;
  if constexpr (std::is_floating_point_v<typename E::Compute>) {
    if (scale != 1) {
      if (nd == 2) return body(ToDsts<E, 2, true>{d0, d1, scale});
      return body(ToDsts<E, 1, true>{d0, d1, scale});
    }
  }
  if (nd == 2) return body(ToDsts<E, 2, false>{d0, d1, scale});
  body(ToDsts<E, 1, false>{d0, d1, scale});
}

// Sources are combined in the order given, so ranks that run this on the same sources
// get bit-identical results. A destination may be a source at the same address (each
// element is read from every source before it is written); no other overlap is allowed.
template <typename E>
PYCOMM_INLINE void reduce_copy_body(RedOp op, typename E::Store* const* dsts, int nd,
                                    const typename E::Store* const* srcs, int k, size_t n,
                                    typename E::Compute scale) {
  using C = typename E::Compute;
  alignas(64) C acc[kBlock];
  const ToAcc<E> to_acc{acc};
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = n - base < kBlock ? n - base : kBlock;
    const auto* first = srcs[0] + base;
    // The cases are spelled out: one helper that folds every source into a sink it is
    // handed stopped GCC vectorising these loops (bf16, two sources: 1.9 ms -> 8 ms).
    if (nd <= 2 && E::kFusedStore) {  // the folds before the last into acc, the last out
      if (k == 1) {
        into_dsts<E>(dsts, nd, base, scale, [&](auto sink) {
          for (size_t i = 0; i < m; ++i) sink(i, E::load(first[i]));
        });
        continue;
      }
      if constexpr (!std::is_same_v<typename E::Store, C>) {
        // A narrow type's last fold stored to two destinations in one loop goes scalar
        // under GCC as often as not, and which cases do moves with unrelated edits (bf16,
        // 256 Ki elements: 2 sources 119 us, 4 sources 354, against 23 and 37 to one):
        // fold everything into acc (in L1), then round and store from there.
        if (nd == 2) {
          fold<E>(op, first, srcs[1] + base, m, to_acc);
          for (int j = 2; j < k; ++j) fold<E>(op, acc, srcs[j] + base, m, to_acc);
          into_dsts<E>(dsts, nd, base, scale, [&](auto sink) {
            for (size_t i = 0; i < m; ++i) sink(i, acc[i]);
          });
          continue;
        }
      }
      if (k == 2) {
        into_dsts<E>(dsts, nd, base, scale,
                     [&](auto sink) { fold<E>(op, first, srcs[1] + base, m, sink); });
        continue;
      }
      fold<E>(op, first, srcs[1] + base, m, to_acc);
      for (int j = 2; j < k - 1; ++j) fold<E>(op, acc, srcs[j] + base, m, to_acc);
      into_dsts<E>(dsts, nd, base, scale, [&](auto sink) {
        fold<E>(op, static_cast<const C*>(acc), srcs[k - 1] + base, m, sink);
      });
      continue;
    }
    if (k == 1) {
      for (size_t i = 0; i < m; ++i) acc[i] = E::load(first[i]);
    } else {
      fold<E>(op, first, srcs[1] + base, m, to_acc);
    }
    for (int j = 2; j < k; ++j) fold<E>(op, acc, srcs[j] + base, m, to_acc);
    if constexpr (std::is_floating_point_v<C>) {
      if (scale != C(1))
        for (size_t i = 0; i < m; ++i) acc[i] *= scale;
    }
    for (int d = 0; d < nd; ++d) {
      auto* out = dsts[d] + base;
      for (size_t i = 0; i < m; ++i) out[i] = E::store(acc[i]);
    }
  }
}

// One entry point per element type, cloned per ISA (see reduce.cc).
#define PYCOMM_REDUCE_COPY(NAME, E)                                                              \
  PYCOMM_CLONES void NAME(RedOp op, E::Store* const* d, int nd, const E::Store* const* s, int k, \
                          size_t n, E::Compute scale) {                                          \
    reduce_copy_body<E>(op, d, nd, s, k, n, scale);                                              \
  }

using F32 = Elem<float, float, float>;
using F64 = Elem<double, double, double>;
using I8 = Elem<uint8_t, uint8_t, int8_t>;
using U8 = Elem<uint8_t, uint8_t, uint8_t>;
using I32 = Elem<uint32_t, uint32_t, int32_t>;
using I64 = Elem<uint64_t, uint64_t, int64_t>;
PYCOMM_REDUCE_COPY(rc_f32, F32)
PYCOMM_REDUCE_COPY(rc_f64, F64)
PYCOMM_REDUCE_COPY(rc_bf16, Bf16Elem)
PYCOMM_REDUCE_COPY(rc_f16, F16Elem)
PYCOMM_REDUCE_COPY(rc_i8, I8)
PYCOMM_REDUCE_COPY(rc_u8, U8)
PYCOMM_REDUCE_COPY(rc_i32, I32)
PYCOMM_REDUCE_COPY(rc_i64, I64)

// float16 where the CPU converts it (f16c.h). SUM (and AVG), the reduction of gradients,
// of 1-4 sources into 1-4 destinations sums in registers. Otherwise each source's block
// is widened into an L1 float block and folded by the float32 kernel, in source order,
// and the result narrowed once into every destination. F16Elem's portable conversions
// ran 1.5-4.6x float32's time, and these 0.3-1.1x (64 Ki elements, AMD EPYC VM).
void rc_f16_converted(RedOp op, uint16_t* const* dsts, int nd, const uint16_t* const* srcs, int k,
                      size_t n, float scale) {
  if (op == RedOp::SUM && sum_f16_registers(dsts, nd, srcs, k, n, scale)) return;
  alignas(64) float acc[kBlock];
  alignas(64) float next[kBlock];
  float* const into_acc[1] = {acc};
  const float* const acc_and_next[2] = {acc, next};
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = n - base < kBlock ? n - base : kBlock;
    f16_to_float_block(srcs[0] + base, acc, m);
    if (k == 1 && scale != 1) rc_f32(op, into_acc, 1, acc_and_next, 1, m, scale);
    for (int j = 1; j < k; ++j) {
      f16_to_float_block(srcs[j] + base, next, m);
      rc_f32(op, into_acc, 1, acc_and_next, 2, m, j == k - 1 ? scale : 1.0f);
    }
    for (int d = 0; d < nd; ++d) float_to_f16_block(acc, dsts[d] + base, m);
  }
}

template <typename E>
void dispatch(RedOp op, void* const* dsts, int nd, const void* const* srcs, int k, size_t n,
              double scale,
              void (*kernel)(RedOp, typename E::Store* const*, int, const typename E::Store* const*,
                             int, size_t, typename E::Compute)) {
  using S = typename E::Store;
  kernel(op, reinterpret_cast<S* const*>(dsts), nd, reinterpret_cast<const S* const*>(srcs), k, n,
         static_cast<typename E::Compute>(scale));
}

}  // namespace

void reduce_copy(DType t, RedOp op, void* const* dsts, int nd, const void* const* srcs, int k,
                 size_t n, double scale) {
  switch (t) {
    case DType::F32:
      return dispatch<F32>(op, dsts, nd, srcs, k, n, scale, rc_f32);
    case DType::F64:
      return dispatch<F64>(op, dsts, nd, srcs, k, n, scale, rc_f64);
    case DType::BF16:
      return dispatch<Bf16Elem>(op, dsts, nd, srcs, k, n, scale, rc_bf16);
    case DType::F16:
      if (f16c_supported())
        return dispatch<F16Elem>(op, dsts, nd, srcs, k, n, scale, rc_f16_converted);
      return dispatch<F16Elem>(op, dsts, nd, srcs, k, n, scale, rc_f16);
    case DType::I8:
      return dispatch<I8>(op, dsts, nd, srcs, k, n, scale, rc_i8);
    case DType::U8:
    case DType::BOOL:
      return dispatch<U8>(op, dsts, nd, srcs, k, n, scale, rc_u8);
    case DType::I32:
      return dispatch<I32>(op, dsts, nd, srcs, k, n, scale, rc_i32);
    case DType::I64:
      return dispatch<I64>(op, dsts, nd, srcs, k, n, scale, rc_i64);
  }
}

}  // namespace pycomm
