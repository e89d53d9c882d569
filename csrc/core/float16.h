// Conversions between 16-bit floats and float, shared by the kernels that compute in
// float registers and store 16-bit values (reductions, fused recompute ops).
#pragma once

#include <cstdint>
#include <cstring>

namespace pycomm {

inline __attribute__((always_inline)) float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline __attribute__((always_inline)) uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : (rounded >> 16));
}

inline __attribute__((always_inline)) float f16_to_float(_Float16 h) {
  return static_cast<float>(h);
}
inline __attribute__((always_inline)) _Float16 float_to_f16(float f) {
  return static_cast<_Float16>(f);
}

}  // namespace pycomm
