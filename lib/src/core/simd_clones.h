// Run-time dispatch for the loops written with GCC/Clang generic vectors
// (vector_size types) rather than with Highway: the function is compiled for
// baseline x86-64, AVX2 and AVX-512, and the loader picks the clone for the
// CPU (an ifunc). The clones compute the same operations in the same order
// (no contraction in ISO C++ mode), so their results are identical.
// Elsewhere (Arm: NEON is baseline) it expands to nothing, and so it does
// under ThreadSanitizer: TSan instruments the clones' ifunc resolver, which
// the dynamic loader runs before TSan's runtime is set up (a crash at load).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(__SANITIZE_THREAD__)
#define KVCAL_SIMD_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
// The 64-byte generic vectors are passed in registers only inside the clones.
#pragma GCC diagnostic ignored "-Wpsabi"
#else
#define KVCAL_SIMD_CLONES
#endif
