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

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

#if defined(_WIN32)
#define KVCAL_RUNTIME_API
#else
#define KVCAL_RUNTIME_API __attribute__((visibility("default")))
#endif

#if defined(__CUDACC__)
#define KVCAL_HD __host__ __device__
#else
#define KVCAL_HD
#endif

namespace kvcal::runtime {

// Every failure the runtime reports: a bad argument, a corrupt or hostile
// bundle, a mask that cannot be built. The message names the problem.
class KVCAL_RUNTIME_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// IEEE binary16 storage: the runtime stores half-precision values as their
// 16-bit patterns, so that no compiler extension is needed in the API.
using half_bits = std::uint16_t;

// binary16 -> binary32, exact (subnormals, infinities and NaN included).
KVCAL_HD inline float half_to_float(half_bits h) {
#if defined(__F16C__) && !defined(__CUDACC__)
  return _cvtsh_ss(h);  // the same result, one instruction
#else
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// binary32 -> binary16, round to nearest even; overflow gives infinity.
KVCAL_HD inline half_bits float_to_half(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<half_bits>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<half_bits>(sign | 0x7c00u);  // rounds past 65504
  if (abs >= 0x38800000u) {                                               // normal half
    const std::uint32_t mant_odd = (abs >> 13) & 1u;
    const std::uint32_t rounded = abs + 0xfffu + mant_odd;
    return static_cast<half_bits>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return static_cast<half_bits>(sign);  // below half the smallest subnormal
  // subnormal half: shift the 24-bit significand, round to nearest even
  const std::uint32_t e = abs >> 23;
  const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  const std::uint32_t r = q + ((rem > halfway || (rem == halfway && (q & 1u))) ? 1u : 0u);
  return static_cast<half_bits>(sign | r);
}

// Bulk conversions (F16C when the build has it).
KVCAL_RUNTIME_API void halves_to_floats(const half_bits* in, std::int64_t n, float* out);
KVCAL_RUNTIME_API void floats_to_halves(const float* in, std::int64_t n, half_bits* out);

}  // namespace kvcal::runtime
