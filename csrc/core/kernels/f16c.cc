#include "core/kernels/f16c.h"

#include <atomic>

#include "core/kernels/float16.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PYCOMM_HAVE_F16C_TARGET 1
#endif

namespace pycomm {
namespace {
std::atomic<bool> f16c_allowed{true};
}  // namespace

bool allow_f16c(bool allowed) { return f16c_allowed.exchange(allowed); }

#ifdef PYCOMM_HAVE_F16C_TARGET

bool f16c_supported() {
  static const bool on_cpu = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return on_cpu && f16c_allowed.load(std::memory_order_relaxed);
}

__attribute__((target("avx,f16c"))) void f16_to_float_block(const uint16_t* src, float* dst,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

__attribute__((target("avx,f16c"))) void float_to_f16_block(const float* src, uint16_t* dst,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

namespace {

// Eight halves as floats (a lambda would not inherit the target, so it is spelled out).
__attribute__((target("avx,f16c"), always_inline)) inline __m256 widen(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// K sources into ND destinations, both fixed, their pointers in locals: the stores go
// through a may-alias vector type, so pointers read from the caller's arrays would be
// reloaded on every iteration (a first version that did ran 1.5-3x slower).
template <int K, int ND>
__attribute__((target("avx,f16c"))) void sum_fixed(uint16_t* const* dsts,
                                                   const uint16_t* const* srcs, size_t n,
                                                   float scale) {
  const uint16_t* s[K];
  uint16_t* o[ND];
  for (int j = 0; j < K; ++j) s[j] = srcs[j];
  for (int d = 0; d < ND; ++d) o[d] = dsts[d];
  const __m256 scale8 = _mm256_set1_ps(scale);
  const bool scaled = scale != 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = widen(s[0] + i);
    for (int j = 1; j < K; ++j) v = _mm256_add_ps(v, widen(s[j] + i));
    if (scaled) v = _mm256_mul_ps(v, scale8);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    for (int d = 0; d < ND; ++d) _mm_storeu_si128(reinterpret_cast<__m128i*>(o[d] + i), h);
  }
  for (; i < n; ++i) {
    float v = _cvtsh_ss(s[0][i]);
    for (int j = 1; j < K; ++j) v += _cvtsh_ss(s[j][i]);
    if (scaled) v *= scale;
    const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    for (int d = 0; d < ND; ++d) o[d][i] = h;
  }
}

template <int K>
void sum_fixed_sources(uint16_t* const* dsts, int nd, const uint16_t* const* srcs, size_t n,
                       float scale) {
  switch (nd) {
    case 1:
      return sum_fixed<K, 1>(dsts, srcs, n, scale);
    case 2:
      return sum_fixed<K, 2>(dsts, srcs, n, scale);
    case 3:
      return sum_fixed<K, 3>(dsts, srcs, n, scale);
    default:
      return sum_fixed<K, 4>(dsts, srcs, n, scale);
  }
}

}  // namespace

bool sum_f16_registers(uint16_t* const* dsts, int nd, const uint16_t* const* srcs, int k, size_t n,
                       float scale) {
  if (nd < 1 || nd > 4) return false;
  switch (k) {
    case 1:
      sum_fixed_sources<1>(dsts, nd, srcs, n, scale);
      return true;
    case 2:
      sum_fixed_sources<2>(dsts, nd, srcs, n, scale);
      return true;
    case 3:
      sum_fixed_sources<3>(dsts, nd, srcs, n, scale);
      return true;
    case 4:
      sum_fixed_sources<4>(dsts, nd, srcs, n, scale);
      return true;
    default:
      return false;
  }
}

#else  // no F16C target: f16c_supported() is false, and these stay portable

bool f16c_supported() { return false; }

void f16_to_float_block(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
}

void float_to_f16_block(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}

bool sum_f16_registers(uint16_t* const*, int, const uint16_t* const*, int, size_t, float) {
  return false;
}

#endif

}  // namespace pycomm
