// What every kvcal::runtime header shares: the export macro, the host/device
// qualifier for layouts that CUDA code will share, the error type and IEEE
// binary16 conversions.
//
// The runtime's public headers include the C++ standard library only: no
// HDF5, Boost, CLI11, fmt or Eigen header, so an engine links
// libkvcal_runtime.so without inheriting any of kvcal's build dependencies.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvcal/core/half.h"

#if defined(_WIN32)
#define KVCAL_RUNTIME_API
#else
#define KVCAL_RUNTIME_API __attribute__((visibility("default")))
#endif

// KVCAL_HD (host/device qualifier) comes from kvcal/core/half.h.

namespace kvcal::runtime {

// Every failure the runtime reports: a bad argument, a corrupt or hostile
// bundle, a mask that cannot be built. The message names the problem.
class KVCAL_RUNTIME_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// IEEE binary16 storage: the runtime stores half-precision values as their
// 16-bit patterns, so that no compiler extension is needed in the API. The
// conversions are kvcal's one fp16 layer (kvcal/core/half.h).
using half_bits = fp16::half_bits;

// binary16 -> binary32, exact (subnormals, infinities and NaN included).
KVCAL_HD inline float half_to_float(half_bits h) { return fp16::to_float(h); }

// binary32 -> binary16, round to nearest even; overflow gives infinity.
KVCAL_HD inline half_bits float_to_half(float f) { return fp16::from_float(f); }

// Bulk conversions, dispatched at run time to the host's SIMD (F16C, NEON, ...);
// bit-for-bit the scalar ones above.
KVCAL_RUNTIME_API void halves_to_floats(const half_bits* in, std::int64_t n, float* out);
KVCAL_RUNTIME_API void floats_to_halves(const float* in, std::int64_t n, half_bits* out);

// The SIMD target the runtime's kernels were dispatched to on this host, by
// its Google Highway name: "AVX3_DL" (AVX-512 with VNNI), "AVX3" (AVX-512),
// "AVX2", "SSE4", "SSSE3", "NEON", "SVE", "SVE2", or "EMU128"/"SCALAR" (no SIMD).
KVCAL_RUNTIME_API std::string simd_target();

// How far ahead, in bytes, the CPU decode's integer kernels request the lines
// of bits-bit codes still in memory on this host (bits 2, 3 or 4; 0 for other
// widths and where no such requests are made). Chosen when the library loads:
// 8 KiB for 3- and 4-bit codes, none for 2-bit ones; 16 KiB for 4-bit codes on
// AMD Zen 4 and 5, and 4 KiB for 2-bit codes on Zen 5; KVCAL_PREFETCH_FAR=<bytes> in
// the environment (0 to 1048576, 0: none) sets every width's distance instead,
// and a value outside that range or not a number is ignored. For benchmarks
// and bug reports.
KVCAL_RUNTIME_API std::int64_t prefetch_far_bytes(int bits);

// How many rows ahead of the rows they read the CPU decode's integer kernels
// request lines into L1 on this host: the key tiles' score kernel (values
// false) or the value kernel (values true): 96 rows for the keys and 64 for
// the values; KVCAL_PREFETCH_NEAR=<rows> in the environment (0 to 4096) sets
// both instead (read when the library loads),
// and a value outside that range or not a number is ignored. For benchmarks
// and bug reports.
KVCAL_RUNTIME_API std::int64_t prefetch_near_rows(bool values);

}  // namespace kvcal::runtime
