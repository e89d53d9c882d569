// Attributes of the CPU kernels. PYCOMM_CLONES builds AVX-512, AVX2 and baseline copies
// of a function and picks one at load time (GCC target_clones), so one wheel is fast on
// every x86-64 machine; PYCOMM_INLINE forces the small helpers inside them inline, so
// each clone gets them compiled for its own ISA.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYCOMM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PYCOMM_CLONES
#endif
#define PYCOMM_INLINE inline __attribute__((always_inline))
