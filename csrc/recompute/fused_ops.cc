#include "recompute/fused_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/kernels/float16.h"
#include "core/kernels/kernel_attrs.h"

namespace pycomm {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

struct F32 {
  using T = float;
  static float load(const T* p, size_t i) { return p[i]; }
  static void store(T* p, size_t i, float v) { p[i] = v; }
};
struct BF16 {
  using T = uint16_t;
  static float load(const T* p, size_t i) { return bf16_to_float(p[i]); }
  static void store(T* p, size_t i, float v) { p[i] = float_to_bf16(v); }
};

// erf as an odd rational function on [-4, 4] (erf is +-1 in float beyond): the
// approximation Eigen and XLA vectorise, a few ulp from libm's erff, no branches, so the
// loops below vectorise where a call to erff would not.
inline float fast_erf(float a) {
  const float x = a < -4.0f ? -4.0f : (a > 4.0f ? 4.0f : a);
  const float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p / q;
}

// exp(x) = 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by Cephes' exp2f polynomial.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float gelu(float z) { return 0.5f * z * (1.0f + fast_erf(z * kInvSqrt2)); }
inline float gelu_grad(float z) {
  return 0.5f * (1.0f + fast_erf(z * kInvSqrt2)) + z * kInvSqrt2Pi * fast_exp(-0.5f * z * z);
}

// Calls fn(i, c, n) for runs [i, i + n) of elements within one row, c the column of i,
// so the inner loops walk the bias contiguously and vectorise.
template <typename Fn>
inline void by_rows(size_t begin, size_t end, size_t cols, Fn&& fn) {
  for (size_t i = begin; i < end;) {
    size_t c = i % cols;
    size_t n = std::min(cols - c, end - i);
    fn(i, c, n);
    i += n;
  }
}

// splitmix64: a counter-based generator; one call per element index.
inline uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t threshold(float p) {
  return static_cast<uint32_t>(std::fmin(p, 1.0f) * 4294967295.0f);
}

inline bool keeps(uint64_t seed, size_t i, uint32_t limit) {
  return static_cast<uint32_t>(mix(seed ^ mix(i)) >> 32) >= limit;
}

template <typename D>
PYCOMM_CLONES void gelu_fwd(void* y, const void* x, const void* b, size_t begin, size_t end,
                            size_t cols) {
  auto* out = static_cast<typename D::T*>(y);
  auto *in = static_cast<const typename D::T*>(x), *bias = static_cast<const typename D::T*>(b);
  by_rows(begin, end, cols, [&](size_t i, size_t c, size_t n) {
    for (size_t k = 0; k < n; ++k)
      D::store(out, i + k, gelu(D::load(in, i + k) + D::load(bias, c + k)));
  });
}

template <typename D>
PYCOMM_CLONES void gelu_bwd(void* gx, const void* g, const void* x, const void* b, size_t begin,
                            size_t end, size_t cols) {
  auto* out = static_cast<typename D::T*>(gx);
  auto *grad = static_cast<const typename D::T*>(g), *in = static_cast<const typename D::T*>(x);
  auto* bias = static_cast<const typename D::T*>(b);
  by_rows(begin, end, cols, [&](size_t i, size_t c, size_t n) {
    for (size_t k = 0; k < n; ++k) {
      float z = D::load(in, i + k) + D::load(bias, c + k);
      D::store(out, i + k, D::load(grad, i + k) * gelu_grad(z));
    }
  });
}

template <typename D>
PYCOMM_CLONES void bda_fwd(void* y, const void* x, const void* b, const void* r, float p,
                           uint64_t seed, size_t begin, size_t end, size_t cols) {
  auto* out = static_cast<typename D::T*>(y);
  auto *in = static_cast<const typename D::T*>(x), *bias = static_cast<const typename D::T*>(b);
  auto* res = static_cast<const typename D::T*>(r);
  const uint32_t limit = threshold(p);
  const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  by_rows(begin, end, cols, [&](size_t i, size_t c, size_t n) {
    for (size_t k = 0; k < n; ++k) {
      float v = D::load(in, i + k) + D::load(bias, c + k);
      float kept = (p == 0.0f || keeps(seed, i + k, limit)) ? v * scale : 0.0f;
      D::store(out, i + k, kept + D::load(res, i + k));
    }
  });
}

template <typename D>
PYCOMM_CLONES void dropout_bwd(void* gx, const void* g, float p, uint64_t seed, size_t begin,
                               size_t end) {
  auto* out = static_cast<typename D::T*>(gx);
  auto* grad = static_cast<const typename D::T*>(g);
  const uint32_t limit = threshold(p);
  const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  for (size_t i = begin; i < end; ++i) {
    bool kept = p == 0.0f || keeps(seed, i, limit);
    D::store(out, i, kept ? D::load(grad, i) * scale : 0.0f);
  }
}

}  // namespace

void bias_gelu_forward(FusedDType t, void* y, const void* x, const void* b, size_t begin,
                       size_t end, size_t cols) {
  t == FusedDType::F32 ? gelu_fwd<F32>(y, x, b, begin, end, cols)
                       : gelu_fwd<BF16>(y, x, b, begin, end, cols);
}

void bias_gelu_backward(FusedDType t, void* gx, const void* g, const void* x, const void* b,
                        size_t begin, size_t end, size_t cols) {
  t == FusedDType::F32 ? gelu_bwd<F32>(gx, g, x, b, begin, end, cols)
                       : gelu_bwd<BF16>(gx, g, x, b, begin, end, cols);
}

void bias_dropout_add_forward(FusedDType t, void* y, const void* x, const void* b,
                              const void* residual, float p, uint64_t seed, size_t begin,
                              size_t end, size_t cols) {
  t == FusedDType::F32 ? bda_fwd<F32>(y, x, b, residual, p, seed, begin, end, cols)
                       : bda_fwd<BF16>(y, x, b, residual, p, seed, begin, end, cols);
}

void dropout_backward(FusedDType t, void* gx, const void* g, float p, uint64_t seed, size_t begin,
                      size_t end) {
  t == FusedDType::F32 ? dropout_bwd<F32>(gx, g, p, seed, begin, end)
                       : dropout_bwd<BF16>(gx, g, p, seed, begin, end);
}

bool dropout_keeps(uint64_t seed, size_t i, float p) {
  return p == 0.0f || keeps(seed, i, threshold(p));
}

}  // namespace pycomm
