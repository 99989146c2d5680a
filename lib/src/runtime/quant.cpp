#include "kvcal/runtime/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvcal::runtime {
namespace {

void check_bits(int bits) {
  if (bits < 2 || bits > 4) throw Error("code width must be 2, 3 or 4 bits, got " + std::to_string(bits));
}

// The smallest binary16 value >= x (x finite, >= 0, below 65504).
half_bits half_round_up(float x) {
  half_bits h = float_to_half(x);
  if (half_to_float(h) < x) ++h;  // positive halves are ordered like their bit patterns
  return h;
}

}  // namespace

void pack_codes(const std::uint8_t* codes, std::int64_t n, int bits, std::uint8_t* out) {
  check_bits(bits);
  if (n <= 0) return;  // nothing to write (out may be null)
  const std::int64_t bytes = packed_bytes(n, bits);
  std::memset(out, 0, static_cast<std::size_t>(bytes));
  if (bits == 4) {
    for (std::int64_t i = 0; i + 1 < n; i += 2)
      out[i / 2] = static_cast<std::uint8_t>((codes[i] & 0xf) | ((codes[i + 1] & 0xf) << 4));
    if (n & 1) out[n / 2] = static_cast<std::uint8_t>(codes[n - 1] & 0xf);
    return;
  }
  if (bits == 2) {
    for (std::int64_t i = 0; i < n; ++i)
      out[i >> 2] = static_cast<std::uint8_t>(out[i >> 2] | ((codes[i] & 3) << ((i & 3) * 2)));
    return;
  }
  std::int64_t bit = 0;
  for (std::int64_t i = 0; i < n; ++i, bit += 3) {
    const unsigned v = (codes[i] & 7u) << (bit & 7);
    out[bit >> 3] = static_cast<std::uint8_t>(out[bit >> 3] | (v & 0xffu));
    if ((bit & 7) > 5) out[(bit >> 3) + 1] = static_cast<std::uint8_t>(out[(bit >> 3) + 1] | (v >> 8));
  }
}

void unpack_codes(const std::uint8_t* packed, std::int64_t n, int bits, std::uint8_t* codes) {
  check_bits(bits);
  if (bits == 4) {
    for (std::int64_t i = 0; i + 1 < n; i += 2) {
      codes[i] = packed[i / 2] & 0xf;
      codes[i + 1] = packed[i / 2] >> 4;
    }
    if (n & 1) codes[n - 1] = packed[n / 2] & 0xf;
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) codes[i] = static_cast<std::uint8_t>(packed_code(packed, i, bits));
}

QuantParams quant_params(const half_bits* x, std::int64_t n, std::int64_t stride, int bits, const std::uint8_t* skip,
                         std::int64_t skip_stride) {
  check_bits(bits);
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  half_bits lo_bits = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (skip && skip[i * skip_stride]) continue;
    const half_bits h = x[i * stride];
    const float v = half_to_float(h);
    if (!std::isfinite(v)) throw Error("non-finite value in a quantization group");
    if (v < lo) {
      lo = v;
      lo_bits = h;
    }
    hi = std::max(hi, v);
  }
  QuantParams p;
  if (!(hi >= lo)) return p;  // nothing left to quantize
  p.min = lo_bits == 0x8000u ? half_bits{0} : lo_bits;
  const float range = hi - lo;  // rounded; the loop below makes the coverage exact
  p.delta = range > 0 ? half_round_up(range / static_cast<float>((1 << bits) - 1)) : half_bits{0};
  // min + top * delta must reach hi also after float rounding of the division.
  // In exact arithmetic (double holds these products and sums exactly).
  const double top = static_cast<double>((1 << bits) - 1);
  while (p.delta != 0 && static_cast<double>(half_to_float(p.min)) + top * half_to_float(p.delta) < hi) ++p.delta;
  return p;
}

}  // namespace kvcal::runtime
