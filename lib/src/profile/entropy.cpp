#include "kvcal/profile/entropy.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/simd_clones.h"
#include "kvcal/core/error.h"

namespace kvcal {
namespace {}  // namespace

namespace {

// 16-lane generic vectors: the compiler lowers them to AVX-512, AVX2 or SSE.
typedef float vf16 __attribute__((vector_size(64)));
typedef std::int32_t vi16 __attribute__((vector_size(64)));

[[gnu::always_inline]] inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

[[gnu::always_inline]] inline vf16 splat(float x) { return vf16{} + x; }

// 2^y for y in [-126, 0], lane by lane: k = round(y), 2^(y-k) by its degree-6
// Taylor polynomial on [-1/2, 1/2] (relative error < 1.3e-7), 2^k in the bits.
[[gnu::always_inline]] inline vf16 exp2_nonpositive(vf16 y) {
  const vf16 kf = (y + splat(12582912.0f)) - splat(12582912.0f);  // round to nearest
  const vf16 r = y - kf;
  vf16 p = splat(1.5403530393381609e-4f);     // ln2^6 / 6!
  p = p * r + splat(1.3333558146428443e-3f);  // ln2^5 / 5!
  p = p * r + splat(9.6181291076284772e-3f);  // ln2^4 / 4!
  p = p * r + splat(5.5504108664821580e-2f);  // ln2^3 / 3!
  p = p * r + splat(2.4022650695910071e-1f);  // ln2^2 / 2!
  p = p * r + splat(6.9314718055994531e-1f);  // ln2
  p = p * r + splat(1.0f);
  const vi16 k = __builtin_convertvector(kf, vi16);
  return p * (vf16)((k + 127) << 23);
}

}  // namespace

namespace detail {

// The two vector passes of token_stats, compiled per x86-64 SIMD level
// (core/simd_clones.h). They throw nothing: the checks stay in token_stats.
KVCAL_SIMD_CLONES void token_max(const float* z, std::int64_t v, float* max_out, bool* bad_out) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::int64_t vec_end = v / 16 * 16;
  // Pass 1: the maximum, and whether any entry is NaN or +inf.
  float m = -kInf;
  bool bad = false;
  {
    vf16 mv = splat(-kInf);
    vi16 ok = vi16{} - 1;
    for (std::int64_t i = 0; i < vec_end; i += 16) {
      const vf16 x = load16(z + i);
      mv = x > mv ? x : mv;
      ok &= x < splat(kInf);  // false for NaN and +inf
    }
    for (int l = 0; l < 16; ++l) {
      m = std::max(m, mv[l]);
      bad |= ok[l] == 0;
    }
    for (std::int64_t i = vec_end; i < v; ++i) {
      m = std::max(m, z[i]);
      bad |= !(z[i] < kInf);
    }
  }
  *max_out = m;
  *bad_out = bad;
}

KVCAL_SIMD_CLONES void token_moments(const float* z, std::int64_t v, float m, double* out) {
  const std::int64_t vec_end = v / 16 * 16;
  // Pass 2 (the row is in cache now), in base 2: y = (z - m) log2(e), clamped
  // at -126 (a masked -inf logit then weighs 2^-126 ~ 1e-38: nothing next to
  // the maximum's weight of 1). s = sum 2^y, s1 = sum 2^y y, s2 = sum 2^y y^2;
  // lanes accumulate blocks of 16 vectors in float, blocks add up in double.
  constexpr float kLog2e = 1.44269504088896341f;
  double s = 0, s1 = 0, s2 = 0;
  const vf16 shift = splat(-m * kLog2e), floor = splat(-126.0f);
  for (std::int64_t block = 0; block < vec_end; block += 256) {
    const std::int64_t end = std::min(vec_end, block + 256);
    vf16 a0{}, a1{}, a2{};
    for (std::int64_t i = block; i < end; i += 16) {
      vf16 y = load16(z + i) * splat(kLog2e) + shift;
      y = y > floor ? y : floor;
      const vf16 e = exp2_nonpositive(y);
      const vf16 t = e * y;
      a0 += e;
      a1 += t;
      a2 += t * y;
    }
    for (int l = 0; l < 16; ++l) s += a0[l], s1 += a1[l], s2 += a2[l];
  }
  for (std::int64_t i = vec_end; i < v; ++i) {
    const float y = std::max(z[i] * kLog2e - m * kLog2e, -126.0f);
    const double e = std::exp2(static_cast<double>(y));
    s += e;
    s1 += e * y;
    s2 += e * y * y;
  }
  out[0] = s, out[1] = s1, out[2] = s2;
}

}  // namespace detail

TokenStats token_stats(const float* z, std::int64_t v) {
  KVCAL_CHECK(v >= 1, "a logits row needs at least one entry (V = 0)");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float m = -kInf;
  bool bad = false;
  detail::token_max(z, v, &m, &bad);
  if (bad) {
    for (std::int64_t i = 0; i < v; ++i) {
      KVCAL_CHECK(z[i] < kInf, "logit {} at index {} is {}", z[i], i, std::isnan(z[i]) ? "NaN" : "+inf");
    }
  }
  KVCAL_CHECK(m > -kInf, "every logit of the row is -inf");

  double sums[3];
  detail::token_moments(z, v, m, sums);
  double s = sums[0], s1 = sums[1], s2 = sums[2];
  // Back to nats: x = y ln 2.
  constexpr double kLn2 = 0.69314718055994530942;
  s1 *= kLn2;
  s2 *= kLn2 * kLn2;
  const double mean = s1 / s;
  TokenStats t;
  t.entropy = std::max(0.0, std::log(s) - mean);
  t.varentropy = std::max(0.0, s2 / s - mean * mean);
  return t;
}

void token_stats_rows(const float* logits, std::int64_t rows, std::int64_t v, double* entropy, double* varentropy,
                      int threads, std::int64_t first_position) {
  KVCAL_CHECK(v >= 1, "logits have V = 0 entries per row");
  if (threads <= 0) threads = omp_get_max_threads();
  std::int64_t bad_row = -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * v > 100000)
  for (std::int64_t r = 0; r < rows; ++r) {
    try {
      const TokenStats t = token_stats(logits + r * v, v);
      entropy[r] = t.entropy;
      varentropy[r] = t.varentropy;
    } catch (const Error&) {
#pragma omp critical(kvcal_entropy_error)
      if (bad_row < 0 || r < bad_row) bad_row = r;
    }
  }
  if (bad_row >= 0) {
    try {
      token_stats(logits + bad_row * v, v);
    } catch (const Error& e) {
      fail("position {}: {}", first_position + bad_row, e.what());
    }
  }
}

const char* to_string(PageVarentropy p) { return p == PageVarentropy::mean ? "mean" : "temporal"; }
PageVarentropy parse_page_varentropy(const std::string& name) {
  if (name == "mean") return PageVarentropy::mean;
  if (name == "temporal") return PageVarentropy::temporal;
  fail("unknown page varentropy '{}': use mean or temporal", name);
}

const char* to_string(TriggerRule r) { return r == TriggerRule::both ? "and" : "or"; }
TriggerRule parse_trigger_rule(const std::string& name) {
  if (name == "and") return TriggerRule::both;
  if (name == "or") return TriggerRule::either;
  fail("unknown trigger rule '{}': use and or or", name);
}

void page_stats(const std::vector<double>& entropy, const std::vector<double>& varentropy, const PageOptions& o,
                std::vector<double>& page_entropy, std::vector<double>& page_varentropy) {
  KVCAL_CHECK(o.page_size >= 1, "page size {} must be at least 1", o.page_size);
  KVCAL_CHECK(entropy.size() == varentropy.size(), "token entropy and varentropy differ in length ({} vs {})",
              entropy.size(), varentropy.size());
  const auto n = static_cast<std::int64_t>(entropy.size());
  for (std::int64_t start = 0; start < n; start += o.page_size) {
    const std::int64_t len = std::min(o.page_size, n - start);
    if (len < o.page_size && !o.keep_partial) break;
    double he = 0, hv = 0;
    for (std::int64_t i = start; i < start + len; ++i) he += entropy[i], hv += varentropy[i];
    const double mean_h = he / static_cast<double>(len);
    double pv = hv / static_cast<double>(len);
    if (o.varentropy == PageVarentropy::temporal) {
      double acc = 0;
      for (std::int64_t i = start; i < start + len; ++i) acc += (entropy[i] - mean_h) * (entropy[i] - mean_h);
      pv = acc / static_cast<double>(len);
    }
    page_entropy.push_back(mean_h);
    page_varentropy.push_back(pv);
  }
}

double percentile(std::vector<double> v, double q) {
  KVCAL_CHECK(!v.empty(), "percentile of an empty set");
  KVCAL_CHECK(q >= 0 && q <= 100, "percentile {} must lie in [0, 100]", q);
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

}  // namespace kvcal
