// Element-wise reduction kernels (vectorised, with a runtime pick of the widest ISA).
#pragma once

#include <cstddef>

#include "core/base/types.h"

namespace pycomm {

// Throws InvalidArgument naming both when `op` makes no sense for `t`
// (AVG on integers, bitwise ops on floats, ...).
void check_reduction(DType t, RedOp op);

// The op the kernels run for `op` on `t`: AVG becomes SUM (the caller scales), and on
// bool SUM/MAX/BOR are a logical or, PRODUCT/MIN/BAND a logical and.
RedOp kernel_op(DType t, RedOp op);

// dst[i] = scale * (a[i] op b[i]). dst may alias a or b. `scale` is applied to floating
// types only (1.0 means none); 16-bit floats are computed in float32, rounded once.
void reduce_pair(DType t, RedOp op, void* dst, const void* a, const void* b, size_t n,
                 double scale = 1.0);

// dst[i] = scale * (srcs[0][i] op ... op srcs[k-1][i]), in source order, so every rank
// that runs it on the same sources gets bit-identical results. 16-bit floats
// accumulate in float32 and round once. dst may be a source at the same address; no
// other overlap.
void reduce_many(DType t, RedOp op, void* dst, const void* const* srcs, int k, size_t n,
                 double scale = 1.0);

// Every dsts[d][i] = scale * (srcs[0][i] op ... op srcs[k-1][i]), in one pass: each
// source read once, the result written to all nd destinations (reduce_copy.cc). Source
// order and rounding as reduce_many. A destination may be a source at the same address;
// no other overlap.
void reduce_copy(DType t, RedOp op, void* const* dsts, int nd, const void* const* srcs, int k,
                 size_t n, double scale = 1.0);

// dst[i] = scale * src[i] for floating types (used by AVG on one rank, PREMUL_SUM).
void scale_copy(DType t, void* dst, const void* src, size_t n, double scale);

// Which copy of the kernels this CPU runs (see kernel_attrs.h): "x86-64-v4 (AVX-512)",
// "x86-64-v3 (AVX2)", "x86-64 (SSE2)", or "portable" where no copies are built.
const char* kernel_isa();

}  // namespace pycomm
