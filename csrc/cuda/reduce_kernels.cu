#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/reduce_kernels.cuh"

namespace pycomm {
namespace cuda {
namespace {

// The arithmetic type a storage type accumulates in.
template <typename T>
struct Acc {
  using type = T;
  __device__ static T in(T v) { return v; }
  __device__ static T out(T v) { return v; }
};
template <>
struct Acc<__half> {
  using type = float;
  __device__ static float in(__half v) { return __half2float(v); }
  __device__ static __half out(float v) { return __float2half_rn(v); }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  __device__ static float in(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 out(float v) { return __float2bfloat16_rn(v); }
};

template <RedOp OP>
struct Combine {
  template <typename A>
  __device__ static A apply(A a, A b) {
    if constexpr (OP == RedOp::SUM) {
      return a + b;
    } else if constexpr (OP == RedOp::PROD) {
      return a * b;
    } else if constexpr (OP == RedOp::MIN) {
      return (b < a || b != b) ? b : a;  // NaN wins, as torch's min
    } else {
      return (b > a || b != b) ? b : a;
    }
  }
};

template <typename T>
constexpr bool kScaled = !std::is_integral<T>::value;

struct Args {
  void* dsts[kMaxDests];
  const void* srcs[kMaxSources];
  int ndst, nsrc;
  size_t n;
  float scale;
  bool vector;  // every pointer 16-byte aligned
};

template <typename T, RedOp OP>
__device__ __forceinline__ typename Acc<T>::type element(const Args& a, size_t i) {
  using A = typename Acc<T>::type;
  A acc = Acc<T>::in(static_cast<const T*>(a.srcs[0])[i]);
#pragma unroll
  for (int s = 1; s < kMaxSources; ++s) {
    if (s < a.nsrc) acc = Combine<OP>::apply(acc, Acc<T>::in(static_cast<const T*>(a.srcs[s])[i]));
  }
  if constexpr (kScaled<T>) {
    if (a.scale != 1.0f) acc = static_cast<A>(acc * static_cast<A>(a.scale));
  }
  return acc;
}

// One 16-byte vector per iteration (V elements), sources combined in order so every
// rank computing the same chunk gets identical bits; then the scalar tail.
template <typename T, RedOp OP>
__global__ void copy_reduce_kernel(Args a) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / sizeof(T);
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t nvec = a.vector ? a.n / V : 0;
  for (size_t v = tid; v < nvec; v += stride) {
    union {
      uint4 raw;
      T e[V];
    } in, out;
    A acc[V];
    in.raw = static_cast<const uint4*>(a.srcs[0])[v];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = Acc<T>::in(in.e[j]);
#pragma unroll
    for (int s = 1; s < kMaxSources; ++s) {
      if (s < a.nsrc) {
        in.raw = static_cast<const uint4*>(a.srcs[s])[v];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = Combine<OP>::apply(acc[j], Acc<T>::in(in.e[j]));
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if constexpr (kScaled<T>) {
        if (a.scale != 1.0f) acc[j] = static_cast<A>(acc[j] * static_cast<A>(a.scale));
      }
      out.e[j] = Acc<T>::out(acc[j]);
    }
#pragma unroll
    for (int d = 0; d < kMaxDests; ++d) {
      if (d < a.ndst) static_cast<uint4*>(a.dsts[d])[v] = out.raw;
    }
  }
  for (size_t i = nvec * V + tid; i < a.n; i += stride) {
    T value = Acc<T>::out(element<T, OP>(a, i));
#pragma unroll
    for (int d = 0; d < kMaxDests; ++d) {
      if (d < a.ndst) static_cast<T*>(a.dsts[d])[i] = value;
    }
  }
}

int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 80;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 80;
  }
  return sms;
}

template <typename T, RedOp OP>
cudaError_t launch(const Args& a, size_t elems_per_thread, cudaStream_t stream) {
  constexpr int kThreads = 512;
  // Enough blocks to fill every SM a few times over; more only adds scheduling.
  size_t want = (a.n / elems_per_thread + kThreads - 1) / kThreads;
  size_t cap = static_cast<size_t>(sm_count()) * 4;
  unsigned blocks = static_cast<unsigned>(want < 1 ? 1 : (want > cap ? cap : want));
  copy_reduce_kernel<T, OP><<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_op(RedOp op, const Args& a, cudaStream_t stream) {
  const size_t v = 16 / sizeof(T);
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
      return launch<T, RedOp::SUM>(a, v, stream);
    case RedOp::PROD:
      return launch<T, RedOp::PROD>(a, v, stream);
    case RedOp::MIN:
      return launch<T, RedOp::MIN>(a, v, stream);
    case RedOp::MAX:
      return launch<T, RedOp::MAX>(a, v, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool reduce_supported(DType t, RedOp op) {
  bool op_ok = op == RedOp::SUM || op == RedOp::AVG || op == RedOp::PROD || op == RedOp::MIN ||
               op == RedOp::MAX;
  bool floating = t == DType::F32 || t == DType::F64 || t == DType::F16 || t == DType::BF16;
  bool integral = t == DType::I32 || t == DType::I64;
  return op_ok && (floating || (integral && op != RedOp::AVG));
}

cudaError_t copy_reduce(DType t, RedOp op, void* const* dsts, int ndst, const void* const* srcs,
                        int nsrc, size_t n, float scale, cudaStream_t stream) {
  if (ndst < 1 || ndst > kMaxDests || nsrc < 1 || nsrc > kMaxSources) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  Args a{};
  a.ndst = ndst;
  a.nsrc = nsrc;
  a.n = n;
  a.scale = scale;
  a.vector = true;
  for (int d = 0; d < ndst; ++d) {
    a.dsts[d] = dsts[d];
    a.vector = a.vector && aligned16(dsts[d]);
  }
  for (int s = 0; s < nsrc; ++s) {
    a.srcs[s] = srcs[s];
    a.vector = a.vector && aligned16(srcs[s]);
  }
  if (nsrc == 1 && scale == 1.0f) {
    // A plain copy: move bytes whatever the dtype (n * size bytes as uint8 lanes of 16).
    size_t bytes = n * dtype_size(t);
    if (a.vector && bytes % 16 == 0) {
      a.n = bytes / 4;
      return launch<uint32_t, RedOp::SUM>(a, 4, stream);
    }
    a.n = bytes;
    a.vector = false;
    return launch<uint8_t, RedOp::SUM>(a, 1, stream);
  }
  switch (t) {
    case DType::F32:
      return dispatch_op<float>(op, a, stream);
    case DType::F64:
      return dispatch_op<double>(op, a, stream);
    case DType::F16:
      return dispatch_op<__half>(op, a, stream);
    case DType::BF16:
      return dispatch_op<__nv_bfloat16>(op, a, stream);
    case DType::I32:
      return dispatch_op<int32_t>(op, a, stream);
    case DType::I64:
      return dispatch_op<int64_t>(op, a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace pycomm
