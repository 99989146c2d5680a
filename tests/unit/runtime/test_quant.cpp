// Tests of the runtime's binary16 conversions (common.h), bit packing and
// min-max group quantization (quant.h). Every expectation is checked against
// an independent computation written here: binary16 values decoded with
// ldexp, round-to-nearest-even by a search over the ordered binary16 values
// in double precision, bit packing one bit at a time, group minima and maxima
// by plain loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/quant.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvcal::runtime {
namespace {

// ------------------------------------------------------------ references

bool half_is_nan(half_bits h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// The value of a binary16 pattern from its definition (not NaN).
double ref_half_value(half_bits h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double s = (h & 0x8000u) ? -1.0 : 1.0;
  if (e == 0x1f) return s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), -24);
  return s * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

// Magnitude of a non-negative pattern <= 0x7c00, with 0x7c00 standing for
// 2^16: the value the next binary16 would have if the exponent did not end,
// which is how IEEE 754 decides overflow under round-to-nearest.
double ref_magnitude(half_bits h) { return h == 0x7c00u ? 65536.0 : ref_half_value(h); }

// float -> binary16 by round to nearest, ties to even, derived from the
// ordering of binary16 values: binary search for the largest pattern not above
// |f|, then compare the two distances (exact in double).
half_bits ref_float_to_half(float f) {
  if (std::isnan(f)) return 0x7e00u;
  const half_bits sign = std::signbit(f) ? 0x8000u : 0u;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65536.0) return static_cast<half_bits>(sign | 0x7c00u);
  unsigned lo = 0, hi = 0x7c00u;  // ref_magnitude(lo) <= a < ref_magnitude(hi)
  while (hi - lo > 1) {
    const unsigned mid = (lo + hi) / 2;
    if (ref_magnitude(static_cast<half_bits>(mid)) <= a)
      lo = mid;
    else
      hi = mid;
  }
  const double dlo = a - ref_magnitude(static_cast<half_bits>(lo));
  const double dhi = ref_magnitude(static_cast<half_bits>(hi)) - a;
  unsigned r;
  if (dlo < dhi)
    r = lo;
  else if (dhi < dlo)
    r = hi;
  else
    r = (lo & 1u) ? hi : lo;
  return static_cast<half_bits>(sign | r);
}

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Floats that probe every rounding case: every binary16 value, the exact
// midpoints between neighbours (ties), one float ulp either side of them,
// both signs, values around the overflow threshold and the subnormal range,
// plus random bit patterns (within the binary16 exponent range and anywhere).
std::vector<float> probe_floats() {
  std::vector<float> out;
  for (unsigned h = 0; h < 0x7c00u; ++h) {
    const double v = ref_half_value(static_cast<half_bits>(h));
    const double next = ref_magnitude(static_cast<half_bits>(h + 1));
    const auto mid = static_cast<float>((v + next) / 2);  // exact: 12 significant bits
    const float cands[] = {static_cast<float>(v), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)};
    for (const float c : cands) {
      out.push_back(c);
      out.push_back(-c);
    }
  }
  const float specials[] = {65504.0f,
                            65519.0f,
                            65519.996f,
                            65520.0f,
                            65520.004f,
                            65536.0f,
                            1e6f,
                            3e38f,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            std::ldexp(1.0f, -25),
                            std::nextafter(std::ldexp(1.0f, -25), 1.0f),
                            std::nextafter(std::ldexp(1.0f, -25), 0.0f),
                            std::ldexp(1.0f, -26),
                            std::ldexp(3.0f, -26),
                            std::ldexp(1.0f, -14),
                            std::nextafter(std::ldexp(1.0f, -14), 0.0f),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            0.0f};
  for (const float s : specials) {
    out.push_back(s);
    out.push_back(-s);
  }
  std::mt19937_64 rng(0x5eed0001);
  for (int i = 0; i < 200000; ++i) {
    const auto r = static_cast<std::uint32_t>(rng());
    // exponent 96..160: from far below the smallest subnormal to past overflow
    const std::uint32_t e = 96u + static_cast<std::uint32_t>(rng() % 65);
    out.push_back(bits_float((r & 0x807fffffu) | (e << 23)));
    const float any = bits_float(static_cast<std::uint32_t>(rng()));
    if (!std::isnan(any)) out.push_back(any);
  }
  return out;
}

// ------------------------------------------------------------ fp16

TEST(RuntimeQuant, HalfToFloatExactForAllPatterns) {
  for (unsigned u = 0; u < 0x10000u; ++u) {
    const auto h = static_cast<half_bits>(u);
    const float f = half_to_float(h);
    if (half_is_nan(h)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << u;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref_half_value(h)) << std::hex << u;
    ASSERT_EQ(std::signbit(f), (u & 0x8000u) != 0) << std::hex << u;  // -0 stays -0
  }
}

TEST(RuntimeQuant, HalfRoundTripAllPatterns) {
  for (unsigned u = 0; u < 0x10000u; ++u) {
    const auto h = static_cast<half_bits>(u);
    const half_bits back = float_to_half(half_to_float(h));
    if (half_is_nan(h)) {
      EXPECT_TRUE(half_is_nan(back)) << std::hex << u << " -> " << back;  // NaN stays NaN, never inf
      EXPECT_EQ(back & 0x8000u, u & 0x8000u);
    } else {
      ASSERT_EQ(back, h) << std::hex << u;
    }
  }
}

TEST(RuntimeQuant, FloatToHalfRoundsToNearestEven) {
  const std::vector<float> probes = probe_floats();
  std::size_t checked = 0;
  for (const float f : probes) {
    const half_bits got = float_to_half(f);
    const half_bits want = ref_float_to_half(f);
    ASSERT_EQ(got, want) << "f = " << f << " (bits " << std::hex << float_bits(f) << ")";
    ++checked;
  }
  EXPECT_GT(checked, 500000u);
  // NaN inputs give NaN (any payload, the sign kept).
  for (const std::uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fbfffffu, 0xff800001u}) {
    const half_bits h = float_to_half(bits_float(nan));
    EXPECT_TRUE(half_is_nan(h)) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (nan >> 16) & 0x8000u);
  }
}

TEST(RuntimeQuant, FloatToHalfKnownValues) {
  // Hand-checked landmarks.
  EXPECT_EQ(float_to_half(1.0f), 0x3c00u);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000u);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bffu);  // largest finite
  EXPECT_EQ(float_to_half(65519.0f), 0x7bffu);  // below the midpoint to 2^16
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00u);  // tie: 2^16 has the even significand -> inf
  EXPECT_EQ(float_to_half(-1e9f), 0xfc00u);     // overflow to -inf
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00u);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001u);         // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000u);         // tie with 0 -> even (0)
  EXPECT_EQ(float_to_half(std::ldexp(3.0f, -25)), 0x0002u);         // 1.5 ulp: tie -> even (2)
  EXPECT_EQ(float_to_half(std::ldexp(5.0f, -25)), 0x0002u);         // 2.5 ulp: tie -> even (2)
  EXPECT_EQ(float_to_half(-std::ldexp(1.0f, -26)), 0x8000u);        // underflow keeps the sign
  EXPECT_EQ(float_to_half(std::ldexp(1023.0f, -24)), 0x03ffu);      // largest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(2047.0f, -25)), 0x0400u);      // rounds up into the normals
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00u);  // tie -> even
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(3.0f, -11)), 0x3c02u);  // tie -> even (up)
}

#if defined(__F16C__)
TEST(RuntimeQuant, FloatToHalfMatchesF16C) {
  for (const float f : probe_floats()) {
    const auto hw = static_cast<half_bits>(_cvtss_sh(f, 0));  // 0: round to nearest even
    ASSERT_EQ(float_to_half(f), hw) << "f = " << f;
  }
  for (unsigned u = 0; u < 0x10000u; ++u) {
    const auto h = static_cast<half_bits>(u);
    if (half_is_nan(h)) continue;
    ASSERT_EQ(float_bits(half_to_float(h)), float_bits(_cvtsh_ss(h))) << std::hex << u;
  }
}
#endif

TEST(RuntimeQuant, BulkConversionsEqualScalar) {
  std::mt19937_64 rng(0x5eed0002);
  const std::vector<float> probes = probe_floats();
  for (std::int64_t n = 0; n <= 40; ++n) {
    for (int rep = 0; rep < 8; ++rep) {
      // halves -> floats: random patterns (NaN included), an offset start to
      // exercise unaligned loads, guards after the end.
      std::vector<half_bits> h(static_cast<std::size_t>(n + 1));
      for (auto& x : h) x = static_cast<half_bits>(rng());
      std::vector<float> f(static_cast<std::size_t>(n + 2), 12345.0f);
      halves_to_floats(h.data() + 1, n, f.data() + 1);
      EXPECT_EQ(f[0], 12345.0f);
      EXPECT_EQ(f[static_cast<std::size_t>(n + 1)], 12345.0f);
      for (std::int64_t i = 0; i < n; ++i) {
        const half_bits hi = h[static_cast<std::size_t>(i + 1)];
        const float got = f[static_cast<std::size_t>(i + 1)];
        if (half_is_nan(hi))
          EXPECT_TRUE(std::isnan(got));
        else
          ASSERT_EQ(float_bits(got), float_bits(half_to_float(hi))) << "n " << n << " i " << i;
      }
      // floats -> halves: probes (ties, subnormals, overflow, NaN).
      std::vector<float> src(static_cast<std::size_t>(n + 1));
      for (auto& x : src) x = probes[static_cast<std::size_t>(rng() % probes.size())];
      if (n > 3) src[3] = std::numeric_limits<float>::quiet_NaN();
      std::vector<half_bits> out(static_cast<std::size_t>(n + 2), 0xabcdu);
      floats_to_halves(src.data() + 1, n, out.data() + 1);
      EXPECT_EQ(out[0], 0xabcdu);
      EXPECT_EQ(out[static_cast<std::size_t>(n + 1)], 0xabcdu);
      for (std::int64_t i = 0; i < n; ++i) {
        const float x = src[static_cast<std::size_t>(i + 1)];
        const half_bits got = out[static_cast<std::size_t>(i + 1)];
        if (std::isnan(x))
          EXPECT_TRUE(half_is_nan(got));
        else
          ASSERT_EQ(got, float_to_half(x)) << "n " << n << " i " << i << " x " << x;
      }
    }
  }
}

// ------------------------------------------------------------ packing

std::vector<std::uint8_t> ref_pack(const std::vector<std::uint8_t>& codes, int bits) {
  std::vector<std::uint8_t> out((codes.size() * static_cast<std::size_t>(bits) + 7) / 8, 0);
  for (std::size_t i = 0; i < codes.size(); ++i)
    for (int k = 0; k < bits; ++k)
      if ((codes[i] >> k) & 1u) {
        const std::size_t bit = i * static_cast<std::size_t>(bits) + static_cast<std::size_t>(k);
        out[bit / 8] = static_cast<std::uint8_t>(out[bit / 8] | (1u << (bit % 8)));
      }
  return out;
}

TEST(RuntimeQuant, PackedBytesIsCeil) {
  for (int bits = 2; bits <= 4; ++bits)
    for (std::int64_t n = 0; n < 300; ++n) {
      std::int64_t want = 0;
      while (want * 8 < n * bits) ++want;  // ceil by counting
      EXPECT_EQ(packed_bytes(n, bits), want) << n << " x " << bits;
    }
}

TEST(RuntimeQuant, PackUnpackBitExact) {
  std::mt19937_64 rng(0x5eed0003);
  const std::int64_t lengths[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 63, 64, 65, 127, 128, 129, 1001};
  for (int bits = 2; bits <= 4; ++bits) {
    for (const std::int64_t n : lengths) {
      for (int rep = 0; rep < 5; ++rep) {
        std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
        for (auto& c : codes) c = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1u));
        if (rep == 1) std::fill(codes.begin(), codes.end(), static_cast<std::uint8_t>((1u << bits) - 1u));
        const std::int64_t nb = packed_bytes(n, bits);
        ASSERT_EQ(nb, (n * bits + 7) / 8);
        const std::vector<std::uint8_t> want = ref_pack(codes, bits);
        ASSERT_EQ(static_cast<std::int64_t>(want.size()), nb);

        // Exactly sized output (ASan catches any write past it), pre-filled
        // with garbage that pack must overwrite. (An empty run with a null
        // buffer is PackEmptyRunAcceptsNullBuffers' business: the buffer here
        // has one spare byte when n == 0, so that data() is not null.)
        std::vector<std::uint8_t> packed(static_cast<std::size_t>(std::max<std::int64_t>(nb, 1)), 0xff);
        pack_codes(codes.data(), n, bits, packed.data());
        if (n == 0) {
          EXPECT_EQ(packed[0], 0xff) << "an empty run writes nothing";
          packed.clear();
        }
        ASSERT_EQ(packed, want) << "bits " << bits << " n " << n;
        // Unused high bits of the last byte are zero.
        const std::int64_t used = n * bits - (nb - 1) * 8;  // bits used in the last byte
        if (nb > 0 && used < 8) {
          EXPECT_EQ(packed.back() >> used, 0) << "bits " << bits << " n " << n;
        }

        // Guard bytes around an oversized buffer stay untouched.
        std::vector<std::uint8_t> guarded(static_cast<std::size_t>(nb + 2), 0xa5);
        pack_codes(codes.data(), n, bits, guarded.data() + 1);
        EXPECT_EQ(guarded.front(), 0xa5);
        EXPECT_EQ(guarded.back(), 0xa5);
        EXPECT_TRUE(std::equal(want.begin(), want.end(), guarded.begin() + 1));

        std::vector<std::uint8_t> back(static_cast<std::size_t>(n + 1), 0xee);
        unpack_codes(packed.data(), n, bits, back.data());
        EXPECT_EQ(back.back(), 0xee) << "unpack wrote past n codes";
        back.pop_back();
        ASSERT_EQ(back, codes) << "bits " << bits << " n " << n;

        for (std::int64_t i = 0; i < n; ++i)
          ASSERT_EQ(packed_code(packed.data(), i, bits), codes[static_cast<std::size_t>(i)])
              << "bits " << bits << " i " << i;
      }
    }
  }
}

// An empty run (n == 0, packed_bytes == 0) is a no-op, also for the null
// buffers an empty std::vector hands out. pack_codes calls memset(out, 0, 0)
// with out == nullptr, which is undefined behaviour: UBSan (build/asan)
// reports "null pointer passed as argument 1, which is declared to never be
// null" at quant.cpp's memset and aborts.
TEST(RuntimeQuant, PackEmptyRunAcceptsNullBuffers) {
  std::vector<std::uint8_t> codes, packed;  // both empty: data() may be null
  for (int bits = 2; bits <= 4; ++bits) {
    EXPECT_EQ(packed_bytes(0, bits), 0);
    pack_codes(codes.data(), 0, bits, packed.data());
    unpack_codes(packed.data(), 0, bits, codes.data());
    pack_codes(nullptr, 0, bits, nullptr);
    unpack_codes(nullptr, 0, bits, nullptr);
  }
  SUCCEED();
}

TEST(RuntimeQuant, PackingKnownBytes) {
  // 3-bit codes 1..5 -> bit stream (LSB first) 001 010 011 100 101:
  // bits 0..14 = 1,0,0, 0,1,0, 1,1,0, 0,0,1, 1,0,1: byte 0 has bits 0, 4, 6, 7 set (0xd1);
  // byte 1 (bits 8..15) has 11, 12, 14 set, i.e. its bits 3, 4, 6 (0x58); bit 15 unused.
  const std::uint8_t c3[] = {1, 2, 3, 4, 5};
  std::uint8_t p3[2] = {0xff, 0xff};
  pack_codes(c3, 5, 3, p3);
  EXPECT_EQ(p3[0], 0xd1);
  EXPECT_EQ(p3[1], 0x58);
  const std::uint8_t c2[] = {3, 0, 1, 2, 1};  // 11 00 10 01 | 01
  std::uint8_t p2[2] = {0xff, 0xff};
  pack_codes(c2, 5, 2, p2);
  EXPECT_EQ(p2[0], 0x93);
  EXPECT_EQ(p2[1], 0x01);
  const std::uint8_t c4[] = {0xa, 0x5, 0xf};
  std::uint8_t p4[2] = {0xff, 0xff};
  pack_codes(c4, 3, 4, p4);
  EXPECT_EQ(p4[0], 0x5a);
  EXPECT_EQ(p4[1], 0x0f);
}

TEST(RuntimeQuant, BadCodeWidthThrows) {
  std::uint8_t codes[8] = {0}, packed[8] = {0};
  for (const int bits : {-1, 0, 1, 5, 8}) {
    EXPECT_THROW(pack_codes(codes, 8, bits, packed), Error) << bits;
    EXPECT_THROW(unpack_codes(packed, 8, bits, codes), Error) << bits;
    const half_bits x[2] = {0x3c00u, 0x4000u};
    EXPECT_THROW(quant_params(x, 2, 1, bits), Error) << bits;
  }
}

// ------------------------------------------------------------ quantization

struct GroupRef {
  double lo = 0, hi = 0;
  int count = 0;
};

GroupRef ref_range(const std::vector<half_bits>& x, std::int64_t n, std::int64_t stride, const std::uint8_t* skip,
                   std::int64_t skip_stride) {
  GroupRef g;
  for (std::int64_t i = 0; i < n; ++i) {
    if (skip && skip[i * skip_stride]) continue;
    const double v = ref_half_value(x[static_cast<std::size_t>(i * stride)]);
    if (g.count == 0 || v < g.lo) g.lo = v;
    if (g.count == 0 || v > g.hi) g.hi = v;
    ++g.count;
  }
  return g;
}

// Checks the documented guarantees of quant_params / quantize_value /
// dequantize_value for one group against the plain-loop reference.
void check_group(const std::vector<half_bits>& x, std::int64_t n, std::int64_t stride, int bits,
                 const std::uint8_t* skip, std::int64_t skip_stride, const char* what) {
  SCOPED_TRACE(what);
  const QuantParams p = quant_params(x.data(), n, stride, bits, skip, skip_stride);
  const GroupRef g = ref_range(x, n, stride, skip, skip_stride);
  const double top = (1 << bits) - 1;
  if (g.count == 0) {
    EXPECT_EQ(p.delta, 0u);
    EXPECT_EQ(p.min, 0u);
    return;
  }
  const double mn = ref_half_value(p.min), delta = ref_half_value(p.delta);
  EXPECT_EQ(mn, g.lo) << "min is the group minimum, stored exactly";
  EXPECT_FALSE(p.delta & 0x8000u) << "delta is not negative";
  ASSERT_TRUE(std::isfinite(delta));
  if (g.hi == g.lo) {
    EXPECT_EQ(p.delta, 0u) << "constant group: delta 0";
  } else {
    // Covers the range: min + top * delta >= max (the float-rounded range may
    // fall short by at most one float rounding of max - min; see the
    // exact-arithmetic test below).
    EXPECT_GE(mn + top * delta, g.hi - 1e-7 * (g.hi - g.lo)) << "min " << mn << " delta " << delta;
    // Rounded up, not further: the next smaller binary16 step would not cover
    // the range (up to the same float rounding slack).
    const double smaller = ref_half_value(static_cast<half_bits>(p.delta - 1));
    EXPECT_LT(mn + top * smaller, g.hi + 1e-7 * (g.hi - g.lo)) << "delta not minimal";
  }
  for (std::int64_t i = 0; i < n; ++i) {
    if (skip && skip[i * skip_stride]) continue;
    const half_bits h = x[static_cast<std::size_t>(i * stride)];
    const double v = ref_half_value(h);
    const std::uint8_t c = quantize_value(half_to_float(h), p, bits);
    ASSERT_LE(c, top);
    const float r = dequantize_value(c, p);
    ASSERT_FALSE(std::isnan(r));
    // The reconstruction by the stored parameters (double, independent of dequantize_value).
    const double r_ref = mn + c * delta;
    EXPECT_NEAR(static_cast<double>(r), r_ref, 1e-6 * (std::fabs(r_ref) + std::fabs(mn)) + 1e-30);
    const double tol = 4e-7 * (std::fabs(v) + std::fabs(mn) + top * delta) + 1e-30;
    ASSERT_LE(std::fabs(v - r_ref), delta / 2 + tol)
        << "i " << i << " x " << v << " code " << int(c) << " min " << mn << " delta " << delta;
    ASSERT_LE(std::fabs(v - static_cast<double>(r)), delta / 2 + tol);
    if (delta == 0) {
      EXPECT_EQ(c, 0);
      EXPECT_EQ(static_cast<double>(r), v);  // exact reconstruction of a constant group
    }
  }
}

TEST(RuntimeQuant, QuantizedWithinHalfStep) {
  std::mt19937_64 rng(0x5eed0004);
  struct Range {
    double lo, hi;
  };
  const Range ranges[] = {{-1, 1},        {0, 1},          {-3e-7, 2e-7},   {1e-6, 5e-6},     {-1e-3, 1e-3},
                          {100, 101},     {-200, -100},    {-60000, 60000}, {-60000, -59000}, {0, 60000},
                          {59000, 60000}, {-65504, 65504}, {-1e-2, 60000},  {-5, 5e-5},       {1024, 1040}};
  for (int bits = 2; bits <= 4; ++bits) {
    for (const Range& r : ranges) {
      for (const std::int64_t n : {1, 2, 3, 7, 16, 64, 129}) {
        for (const std::int64_t stride : {1, 3}) {
          std::uniform_real_distribution<double> u(r.lo, r.hi);
          std::vector<half_bits> x(static_cast<std::size_t>(n * stride), 0x7c00u);  // inf between the strided entries
          for (std::int64_t i = 0; i < n; ++i)
            x[static_cast<std::size_t>(i * stride)] = float_to_half(static_cast<float>(u(rng)));
          check_group(x, n, stride, bits, nullptr, 0, "random group");
        }
      }
    }
  }
}

TEST(RuntimeQuant, ExtremeAndSignedZeroGroups) {
  for (int bits = 2; bits <= 4; ++bits) {
    // The widest finite range, subnormal neighbours, signed zeros.
    const std::vector<std::vector<half_bits>> groups = {
        {0xfbffu, 0x7bffu},           // -65504, 65504
        {0xfbffu, 0x0001u, 0x7bffu},  // with a subnormal inside
        {0x0001u, 0x0002u},           // two adjacent subnormals
        {0x8001u, 0x0000u, 0x0001u},  // -tiny, 0, tiny
        {0x8000u, 0x0000u, 0x8000u},  // -0, +0: a constant group
        {0x8000u, 0x3c00u},           // -0 .. 1
        {0x3c00u, 0x3c01u, 0x3c02u, 0x3c03u},
        {0xc000u, 0xbc00u},  // -2 .. -1
    };
    for (const auto& g : groups) check_group(g, static_cast<std::int64_t>(g.size()), 1, bits, nullptr, 0, "extreme");
  }
}

TEST(RuntimeQuant, ConstantGroupsHaveZeroStep) {
  for (int bits = 2; bits <= 4; ++bits)
    for (const half_bits c : {half_bits{0x0000u}, half_bits{0x3c00u}, half_bits{0xd3a5u}, half_bits{0x7bffu},
                              half_bits{0xfbffu}, half_bits{0x0001u}}) {
      const std::vector<half_bits> x(17, c);
      const QuantParams p = quant_params(x.data(), 17, 1, bits);
      EXPECT_EQ(p.delta, 0u);
      EXPECT_EQ(ref_half_value(p.min), ref_half_value(c));
      for (const float probe : {half_to_float(c), 0.0f, 1e4f, -1e4f}) {
        EXPECT_EQ(quantize_value(probe, p, bits), 0);  // no division by zero
        const float r = dequantize_value(quantize_value(probe, p, bits), p);
        EXPECT_FALSE(std::isnan(r));
        EXPECT_EQ(static_cast<double>(r), ref_half_value(c));
      }
      check_group(x, 17, 1, bits, nullptr, 0, "constant");
    }
}

TEST(RuntimeQuant, SkipMaskExcludesEntries) {
  std::mt19937_64 rng(0x5eed0005);
  for (int bits = 2; bits <= 4; ++bits) {
    for (int rep = 0; rep < 40; ++rep) {
      const std::int64_t n = 2 + static_cast<std::int64_t>(rng() % 40);
      const std::int64_t skip_stride = 1 + static_cast<std::int64_t>(rng() % 3);
      std::vector<half_bits> x(static_cast<std::size_t>(n));
      std::uniform_real_distribution<double> u(-4, 4);
      for (auto& v : x) v = float_to_half(static_cast<float>(u(rng)));
      std::vector<std::uint8_t> skip(static_cast<std::size_t>(n * skip_stride), 0);
      // Skip some entries and make them outliers: they must not widen the range.
      for (std::int64_t i = 0; i < n; ++i)
        if (rng() % 4 == 0) {
          skip[static_cast<std::size_t>(i * skip_stride)] = static_cast<std::uint8_t>(1 + rng() % 255);
          x[static_cast<std::size_t>(i)] = float_to_half(rng() % 2 ? 30000.0f : -30000.0f);
        }
      // Entries between the strided skip flags are ignored.
      for (std::size_t i = 0; i < skip.size(); ++i)
        if (i % static_cast<std::size_t>(skip_stride) != 0) skip[i] = 1;
      const QuantParams p = quant_params(x.data(), n, 1, bits, skip.data(), skip_stride);
      const GroupRef g = ref_range(x, n, 1, skip.data(), skip_stride);
      if (g.count > 0) {
        EXPECT_GE(ref_half_value(p.min), -4.0);
        EXPECT_LE(ref_half_value(p.min) + ((1 << bits) - 1) * ref_half_value(p.delta), 4.01);
      }
      check_group(x, n, 1, bits, skip.data(), skip_stride, "skip");
    }
  }
}

TEST(RuntimeQuant, AllSkippedOrEmptyGroup) {
  const std::vector<half_bits> x = {0x3c00u, 0xc000u, 0x7bffu};
  const std::uint8_t all[3] = {1, 1, 1};
  for (int bits = 2; bits <= 4; ++bits) {
    const QuantParams p = quant_params(x.data(), 3, 1, bits, all, 1);
    EXPECT_EQ(p.delta, 0u);
    EXPECT_EQ(p.min, 0u);
    const QuantParams e = quant_params(x.data(), 0, 1, bits);
    EXPECT_EQ(e.delta, 0u);
    EXPECT_EQ(e.min, 0u);
    EXPECT_EQ(dequantize_value(quantize_value(5.0f, p, bits), p), 0.0f);
    // A skipped non-finite entry is not looked at.
    const std::vector<half_bits> y = {0x7c00u, 0x3c00u, 0x7e00u};
    const std::uint8_t sk[3] = {1, 0, 1};
    const QuantParams q = quant_params(y.data(), 3, 1, bits, sk, 1);
    EXPECT_EQ(q.min, 0x3c00u);
    EXPECT_EQ(q.delta, 0u);
  }
}

TEST(RuntimeQuant, NonFiniteInputThrows) {
  for (int bits = 2; bits <= 4; ++bits)
    for (const half_bits bad :
         {half_bits{0x7c00u}, half_bits{0xfc00u}, half_bits{0x7e00u}, half_bits{0x7c01u}, half_bits{0xfe00u}}) {
      for (std::size_t pos = 0; pos < 3; ++pos) {
        std::vector<half_bits> x = {0x3c00u, 0x4000u, 0x4200u};
        x[pos] = bad;
        EXPECT_THROW(quant_params(x.data(), 3, 1, bits), Error) << std::hex << bad << " at " << pos;
      }
    }
}

TEST(RuntimeQuant, QuantizeValueClampsAndRounds) {
  // Group {1, 2.5} at 2 bits: range 1.5, delta = 0.5 exactly, grid 1, 1.5, 2, 2.5.
  const std::vector<half_bits> x = {float_to_half(1.0f), float_to_half(2.5f)};
  const QuantParams p = quant_params(x.data(), 2, 1, 2);
  EXPECT_EQ(half_to_float(p.min), 1.0f);
  EXPECT_EQ(half_to_float(p.delta), 0.5f);
  EXPECT_EQ(quantize_value(-100.0f, p, 2), 0);
  EXPECT_EQ(quantize_value(100.0f, p, 2), 3);
  EXPECT_EQ(quantize_value(1.74f, p, 2), 1);
  EXPECT_EQ(quantize_value(1.76f, p, 2), 2);
  EXPECT_EQ(quantize_value(2.5f, p, 2), 3);
  EXPECT_EQ(dequantize_value(2, p), 2.0f);
  // Range 1 over 15 steps at 4 bits: 1/15 rounded UP to binary16.
  const std::vector<half_bits> y = {float_to_half(0.0f), float_to_half(1.0f)};
  const QuantParams q = quant_params(y.data(), 2, 1, 4);
  const double want = 1.0 / 15.0;
  const double got = ref_half_value(q.delta);
  EXPECT_GE(got, want);
  EXPECT_LT(ref_half_value(static_cast<half_bits>(q.delta - 1)), want);
  EXPECT_EQ(quantize_value(1.0f, q, 4), 15);
}

// The documented guarantee min + (2^b - 1) * delta >= max, in exact
// arithmetic, for a group whose range max - min is not a float: -2^-24 (the
// negative smallest subnormal) and 60000 differ by 60000 + 2^-24, which needs
// 40 significant bits.
TEST(RuntimeQuant, CoverageHoldsInExactArithmetic) {
  const std::vector<half_bits> x = {0x8001u, float_to_half(60000.0f)};
  ASSERT_EQ(ref_half_value(x[1]), 60000.0);
  for (int bits = 2; bits <= 4; ++bits) {
    const QuantParams p = quant_params(x.data(), 2, 1, bits);
    const double mn = ref_half_value(p.min), delta = ref_half_value(p.delta);
    EXPECT_EQ(mn, -std::ldexp(1.0, -24));
    EXPECT_GE(mn + ((1 << bits) - 1) * delta, 60000.0)
        << "bits " << bits << ": min " << mn << " delta " << delta << " falls short of max by "
        << 60000.0 - (mn + ((1 << bits) - 1) * delta);
  }
}

}  // namespace
}  // namespace kvcal::runtime
