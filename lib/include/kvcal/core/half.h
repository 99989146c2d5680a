// IEEE binary16 ("fp16") conversions: the one numeric layer that the artifact
// readers (io), the offline evaluation and the runtime all share.
//
// The header includes the C++ standard library only (the runtime's public
// headers include it), and its scalar conversions compile as CUDA device code.
// The bulk conversions are dispatched at run time to the best SIMD target of
// the host (Google Highway: F16C on x86-64 AVX2 and up, NEON/SVE on Arm); the
// targets without a hardware conversion use the scalar routine. Every target
// gives bit-for-bit the scalar result (NaN inputs give a NaN).
#pragma once

#include <cstdint>
#include <cstring>

#ifndef KVCAL_HD
#if defined(__CUDACC__)
#define KVCAL_HD __host__ __device__
#else
#define KVCAL_HD
#endif
#endif

namespace kvcal::fp16 {

// A binary16 value as its 16-bit pattern: no compiler extension in any API.
using half_bits = std::uint16_t;

// binary16 -> binary32, exact (subnormals, infinities and NaN included).
KVCAL_HD inline float to_float(half_bits h) {
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
}

// binary32 -> binary16, round to nearest even; overflow gives infinity.
KVCAL_HD inline half_bits from_float(float f) {
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

#if !defined(__CUDACC__)
// Bulk conversions of n values (dispatched, see the file comment). The
// runtime library re-exports them as kvcal::runtime::halves_to_floats and
// floats_to_halves.
void to_floats(const half_bits* in, std::int64_t n, float* out);
void from_floats(const float* in, std::int64_t n, half_bits* out);
#endif

}  // namespace kvcal::fp16
