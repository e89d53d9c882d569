// CUDA fused recompute kernels; the CPU reference is csrc/core/fused_ops.cc, and
// tests/test_fused_ops_cuda.py compares the two.
//
// Every kernel is memory-bound and element-wise: thread t handles pack t, N consecutive
// elements moved with one 16-byte load or store (N = 4 float32, 8 bfloat16 or float16),
// computes in float registers and strides over the grid. The last n % N elements, fewer
// than a pack, go one each to the first threads. Tensors whose pointers are not 16-byte
// aligned (views at odd offsets) run the same kernel with N = 1.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "cuda/fused_kernels.cuh"

namespace pycomm {
namespace cuda {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = size_t(1) << 16;  // beyond this the threads stride

// Explicit conversions: torch compiles CUDA with __CUDA_NO_HALF_CONVERSIONS__ and
// __CUDA_NO_BFLOAT16_CONVERSIONS__, so nothing here may rely on the implicit ones.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);  // round to nearest even, as the CPU's float_to_bf16
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// N consecutive elements; aligned to their size so that a copy is one vector access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// The biases of elements [i, i + N), c = i % cols. One vector load when every pack lies
// in one row and the bias is aligned (`packed`: cols % N == 0); otherwise one load per
// element, wrapping at the end of the row. The bias is small and stays in L1.
template <int N, typename T>
__device__ __forceinline__ void load_bias(float (&out)[N], const T* b, size_t c, size_t cols,
                                          bool packed) {
  if (N > 1 && packed) {
    Pack<T, N> p = load<N>(b + c);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(p.v[k]);
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    out[k] = to_float(b[c]);
    if (++c == cols) c = 0;
  }
}

__device__ __forceinline__ float gelu(float z) { return 0.5f * z * (1.0f + erff(z * kInvSqrt2)); }

__device__ __forceinline__ float gelu_grad(float z) {
  return 0.5f * (1.0f + erff(z * kInvSqrt2)) + z * kInvSqrt2Pi * expf(-0.5f * z * z);
}

// splitmix64, the CPU's (fused_ops.cc): element i is kept when the high half of
// mix(seed ^ mix(i)) reaches the threshold. limit = 0 (p = 0) keeps all without hashing.
__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ bool keeps(uint64_t seed, uint64_t i, uint32_t limit) {
  return limit == 0 || static_cast<uint32_t>(mix(seed ^ mix(i)) >> 32) >= limit;
}

template <typename T>
struct BiasGeluForward {
  T* y;
  const T *x, *b;
  size_t cols;
  bool packed_bias;

  template <int N>
  __device__ __forceinline__ void run(size_t i) const {
    Pack<T, N> in = load<N>(x + i), out;
    float bias[N];
    load_bias<N>(bias, b, i % cols, cols, packed_bias);
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = from_float<T>(gelu(to_float(in.v[k]) + bias[k]));
    store<N>(y + i, out);
  }
};

// Recomputes z = x + b in the pass that computes the gradient: nothing of the forward kept.
template <typename T>
struct BiasGeluBackward {
  T* gx;
  const T *g, *x, *b;
  size_t cols;
  bool packed_bias;

  template <int N>
  __device__ __forceinline__ void run(size_t i) const {
    Pack<T, N> grad = load<N>(g + i), in = load<N>(x + i), out;
    float bias[N];
    load_bias<N>(bias, b, i % cols, cols, packed_bias);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float z = to_float(in.v[k]) + bias[k];
      out.v[k] = from_float<T>(to_float(grad.v[k]) * gelu_grad(z));
    }
    store<N>(gx + i, out);
  }
};

template <typename T>
struct BiasDropoutAdd {
  T* y;
  const T *x, *b, *r;
  size_t cols;
  bool packed_bias;
  uint64_t seed;
  uint32_t limit;
  float scale;

  template <int N>
  __device__ __forceinline__ void run(size_t i) const {
    Pack<T, N> in = load<N>(x + i), res = load<N>(r + i), out;
    float bias[N];
    load_bias<N>(bias, b, i % cols, cols, packed_bias);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float v = to_float(in.v[k]) + bias[k];
      float kept = keeps(seed, i + k, limit) ? v * scale : 0.0f;
      out.v[k] = from_float<T>(kept + to_float(res.v[k]));
    }
    store<N>(y + i, out);
  }
};

// The mask is recomputed from the seed: the forward kept none.
template <typename T>
struct DropoutBackward {
  T* gx;
  const T* g;
  uint64_t seed;
  uint32_t limit;
  float scale;

  template <int N>
  __device__ __forceinline__ void run(size_t i) const {
    Pack<T, N> grad = load<N>(g + i), out;
#pragma unroll
    for (int k = 0; k < N; ++k)
      out.v[k] = from_float<T>(keeps(seed, i + k, limit) ? to_float(grad.v[k]) * scale : 0.0f);
    store<N>(gx + i, out);
  }
};

// Pack p is elements [p N, p N + N); thread `first` takes packs first, first + stride, ...
// then, if the tail has an element first, that element alone.
template <int N, typename Op>
__global__ void __launch_bounds__(kThreads) elementwise(Op op, size_t n) {
  const size_t packs = n / N;
  const size_t first = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t p = first; p < packs; p += stride) op.template run<N>(p * N);
  if (N > 1 && packs * N + first < n) op.template run<1>(packs * N + first);
}

bool aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <typename T>
bool packed_bias(const void* b, size_t cols) {
  return cols % (16 / sizeof(T)) == 0 && aligned({b});
}

// One launch on `stream`; `vector`: every streamed pointer is 16-byte aligned.
template <typename T, typename Op>
cudaError_t launch(const Op& op, size_t n, bool vector, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kPack = 16 / sizeof(T);
  const size_t items = vector ? std::max<size_t>(n / kPack, 1) : n;
  const size_t blocks = std::min((items + kThreads - 1) / kThreads, kMaxBlocks);
  if (vector)
    elementwise<kPack><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(op, n);
  else
    elementwise<1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(op, n);
  return cudaGetLastError();
}

// Calls f(T{}) with T the element type of t.
template <typename F>
cudaError_t by_dtype(FusedDType t, F&& f) {
  switch (t) {
    case FusedDType::F32:
      return f(float{});
    case FusedDType::BF16:
      return f(__nv_bfloat16{});
    case FusedDType::F16:
      return f(__half{});
  }
  return cudaErrorInvalidValue;
}

// As the CPU computes them (fused_ops.cc), in float on the host, so the masks agree.
uint32_t threshold(float p) { return static_cast<uint32_t>(std::fmin(p, 1.0f) * 4294967295.0f); }
float keep_scale(float p) { return p > 0.0f ? 1.0f / (1.0f - p) : 1.0f; }

}  // namespace

cudaError_t bias_gelu_forward(FusedDType t, void* y, const void* x, const void* b, size_t n,
                              size_t cols, cudaStream_t stream) {
  return by_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    BiasGeluForward<T> op{static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(b),
                          cols, packed_bias<T>(b, cols)};
    return launch<T>(op, n, aligned({y, x}), stream);
  });
}

cudaError_t bias_gelu_backward(FusedDType t, void* gx, const void* g, const void* x, const void* b,
                               size_t n, size_t cols, cudaStream_t stream) {
  return by_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    BiasGeluBackward<T> op{static_cast<T*>(gx),
                           static_cast<const T*>(g),
                           static_cast<const T*>(x),
                           static_cast<const T*>(b),
                           cols,
                           packed_bias<T>(b, cols)};
    return launch<T>(op, n, aligned({gx, g, x}), stream);
  });
}

cudaError_t bias_dropout_add_forward(FusedDType t, void* y, const void* x, const void* b,
                                     const void* residual, float p, uint64_t seed, size_t n,
                                     size_t cols, cudaStream_t stream) {
  return by_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    BiasDropoutAdd<T> op{static_cast<T*>(y),
                         static_cast<const T*>(x),
                         static_cast<const T*>(b),
                         static_cast<const T*>(residual),
                         cols,
                         packed_bias<T>(b, cols),
                         seed,
                         threshold(p),
                         keep_scale(p)};
    return launch<T>(op, n, aligned({y, x, residual}), stream);
  });
}

cudaError_t dropout_backward(FusedDType t, void* gx, const void* g, float p, uint64_t seed,
                             size_t n, cudaStream_t stream) {
  return by_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    DropoutBackward<T> op{static_cast<T*>(gx), static_cast<const T*>(g), seed, threshold(p),
                          keep_scale(p)};
    return launch<T>(op, n, aligned({gx, g}), stream);
  });
}

}  // namespace cuda
}  // namespace pycomm
