// Conversions between 16-bit floats and float, shared by the kernels that compute in
// float registers and store 16-bit values (reductions, fused recompute ops).
#pragma once

#include <cstdint>
#include <cstring>

namespace pycomm {

inline __attribute__((always_inline)) float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __attribute__((always_inline)) uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline __attribute__((always_inline)) float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even; NaN stays NaN (quiet).
inline __attribute__((always_inline)) uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : (rounded >> 16));
}

// IEEE half <-> float in integer and float arithmetic (the kernels' way on a CPU without
// F16C; f16c.h converts with the instructions where it has them), written as selects so that loops
// over them vectorise. A plain _Float16 cast does not: GCC 12 converts one element at a
// time (vcvtph2ps on a scalar), or calls libgcc on baseline x86-64, which made float16
// reductions 6x slower than bfloat16. Exact, round to nearest even (F. Giesen's
// half_to_float / float_to_half_fast3_rtne), and correct under flush-to-zero and
// denormals-are-zero: no float it computes with is subnormal unless it rounds to zero.

// Half values travel as their bits (uint16_t), as bfloat16 does: GCC vectorises integer
// lanes, not _Float16 ones.
inline __attribute__((always_inline)) float f16_to_float(uint16_t h) {
  uint32_t o = static_cast<uint32_t>(h & 0x7FFFu) << 13;  // exponent and mantissa
  uint32_t exp = o & 0x0F800000u;
  o += (127u - 15u) << 23;  // rebias
  // Subnormal half: make it the normal float 2^-14 * (1 + m/1024), subtract 2^-14.
  uint32_t subnormal = float_to_bits(bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23));
  uint32_t inf_nan = o + ((128u - 16u) << 23);
  o = exp == 0x0F800000u ? inf_nan : (exp == 0 ? subnormal : o);
  return bits_to_float(o | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

inline __attribute__((always_inline)) uint16_t float_to_f16(float value) {
  uint32_t f = float_to_bits(value);
  uint32_t sign = f & 0x80000000u;
  f ^= sign;
  // >= 2^16 (after rounding nothing below it overflows but 65520..65535.99, which the
  // normal path carries into the infinity pattern): infinity, or a quiet NaN.
  uint32_t big = f > 0x7F800000u ? 0x7E00u : 0x7C00u;
  // < 2^-14: adding 0.5 lines the half's subnormal mantissa up with the float's low
  // bits, and the addition rounds to nearest even.
  uint32_t small = float_to_bits(bits_to_float(f) + 0.5f) - (126u << 23);
  uint32_t odd = (f >> 13) & 1u;
  uint32_t normal = (f + ((15u - 127u) << 23) + 0xFFFu + odd) >> 13;
  uint32_t o = f >= (143u << 23) ? big : (f < (113u << 23) ? small : normal);
  return static_cast<uint16_t>(o | (sign >> 16));
}

}  // namespace pycomm
