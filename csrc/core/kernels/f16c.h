// float16 <-> float32 over whole blocks with the CPU's conversion instructions (F16C,
// every x86-64-v3 CPU): vcvtph2ps and vcvtps2ph convert 8 values each, where
// float16.h's portable sequence of integer selects takes a dozen vector instructions per
// 8 and kept float16 reductions 2-4x slower than bfloat16's (AMD EPYC VM). Both round to
// nearest even and give the same bits for every value but a NaN's payload (the
// instruction keeps its top bits; float16.h makes it the canonical quiet NaN): the
// kernels use one or the other on every path of a process, never both.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pycomm {

// Whether the kernels convert with the instructions: this CPU has them (checked once;
// never off x86-64) and allow_f16c has not turned them off.
bool f16c_supported();

// Tests only: false makes every float16 kernel take float16.h's portable conversions, as
// on a CPU without F16C, so both ways stay tested on one machine. Returns the previous
// setting. Not to be called while a kernel runs (one way per process, see above).
bool allow_f16c(bool allowed);

// dst[i] = float(src[i]), i < n. Only where f16c_supported().
void f16_to_float_block(const uint16_t* src, float* dst, size_t n);

// dst[i] = half(src[i]), rounded to nearest even, i < n. Only where f16c_supported().
void float_to_f16_block(const float* src, uint16_t* dst, size_t n);

// Every dsts[d][i] = half(scale * (srcs[0][i] + ... + srcs[k-1][i])), summed in float in
// source order and rounded once, as reduce_copy's contract, each value in a register from
// its first load to its last store. Handles 1-4 sources into 1-4 destinations (every
// case of 2-4 ranks, the zero-copy all_reduce's one destination per rank included) and
// returns true; false for the others (left to the caller). Only where f16c_supported().
bool sum_f16_registers(uint16_t* const* dsts, int nd, const uint16_t* const* srcs, int k, size_t n,
                       float scale);

}  // namespace pycomm
