// KCVT building blocks: bit packing of 2/3/4-bit codes and asymmetric
// min-max quantization of one group.
//
// Packing: codes form one little-endian bit stream; code i occupies bits
// [i*b, (i+1)*b) counted from bit 0 of byte 0, so 3-bit codes straddle byte
// boundaries. A run of n codes takes packed_bytes(n, b) = ceil(n*b/8) bytes;
// the unused high bits of the last byte are zero.
//
// Quantization of a group x_1..x_m (binary16 inputs): min = min x_i is stored
// exactly (it is a binary16 value); the step is
//   delta = (max - min) / (2^b - 1), rounded UP to binary16,
// so that min + (2^b - 1) * delta >= max and every code
//   c_i = clamp(round((x_i - min) / delta), 0, 2^b - 1)
// reconstructs x_i = min + c_i * delta within delta / 2. A constant group
// stores delta = 0 and codes 0 (no division, no NaN).
#pragma once

#include <cstdint>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime {

KVCAL_HD constexpr std::int64_t packed_bytes(std::int64_t n, int bits) { return (n * bits + 7) / 8; }

// Packs n codes (each < 2^bits, bits in {2, 3, 4}) into packed_bytes(n, bits)
// bytes; unpack is the exact inverse.
KVCAL_RUNTIME_API void pack_codes(const std::uint8_t* codes, std::int64_t n, int bits, std::uint8_t* out);
KVCAL_RUNTIME_API void unpack_codes(const std::uint8_t* packed, std::int64_t n, int bits, std::uint8_t* codes);

// Code i of a packed stream (random access; used by the reference paths).
KVCAL_HD inline unsigned packed_code(const std::uint8_t* packed, std::int64_t i, int bits) {
  const std::int64_t bit = i * bits;
  const std::int64_t byte = bit >> 3;
  const unsigned shift = static_cast<unsigned>(bit & 7);
  unsigned word = packed[byte];
  if (shift + static_cast<unsigned>(bits) > 8u) word |= static_cast<unsigned>(packed[byte + 1]) << 8;
  return (word >> shift) & ((1u << bits) - 1u);
}

// Step and minimum of one group, both binary16 (see the file comment).
struct QuantParams {
  half_bits delta = 0;
  half_bits min = 0;
};

// The parameters for the values x[i * stride] (i < n) whose skip[i * skip_stride]
// is zero (skip may be null: no entry skipped). A group with no entry left gets
// delta = min = 0. Inputs must be finite.
KVCAL_RUNTIME_API QuantParams quant_params(const half_bits* x, std::int64_t n, std::int64_t stride, int bits,
                                           const std::uint8_t* skip = nullptr, std::int64_t skip_stride = 0);

// The code of one value under p (clamped to [0, 2^bits - 1]).
KVCAL_HD inline std::uint8_t quantize_value(float x, QuantParams p, int bits) {
  const float delta = half_to_float(p.delta);
  if (!(delta > 0.0f)) return 0;
  const float q = (x - half_to_float(p.min)) / delta;
  const float top = static_cast<float>((1 << bits) - 1);
  const float r = q < 0.0f ? 0.0f : (q > top ? top : q);
  return static_cast<std::uint8_t>(static_cast<int>(r + 0.5f));
}

KVCAL_HD inline float dequantize_value(unsigned code, QuantParams p) {
  return half_to_float(p.min) + static_cast<float>(code) * half_to_float(p.delta);
}

}  // namespace kvcal::runtime
