#include "kvcal/profile/entropy.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvcal/core/error.h"

namespace kvcal {
namespace {

// e^x for x in [-87.3, 0] in float (relative error ~2e-7; the Cephes expf
// polynomial), written so that
// the compiler vectorizes the loops that call it: round-to-nearest by the
// 1.5 * 2^23 trick, a Cody-Waite split of ln 2, a degree-6 polynomial, and
// the exponent built in the bits.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float kf = (x * kLog2e + kRound) - kRound;
  const float r = (x - kf * kLn2Hi) - kf * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto k = static_cast<std::int32_t>(kf);
  const float scale = std::bit_cast<float>((k + 127) << 23);
  return p * scale;
}

}  // namespace

namespace {

// 16-lane generic vectors: the compiler lowers them to AVX-512, AVX2 or SSE.
typedef float vf16 __attribute__((vector_size(64)));
typedef std::int32_t vi16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf16 splat(float x) { return vf16{} + x; }

// Vector form of exp_nonpositive (same operations, lane by lane).
inline vf16 exp_nonpositive(vf16 x) {
  const vf16 kf = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
  const vf16 r = (x - kf * splat(0.693359375f)) - kf * splat(-2.12194440e-4f);
  vf16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi16 k = __builtin_convertvector(kf, vi16);
  const vf16 scale = (vf16)((k + 127) << 23);
  return p * scale;
}

}  // namespace

TokenStats token_stats(const float* z, std::int64_t v) {
  KVCAL_CHECK(v >= 1, "a logits row needs at least one entry (V = 0)");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kLow = -87.3f;  // e^-87.3 is below the float range: contributes nothing
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
  if (bad) {
    for (std::int64_t i = 0; i < v; ++i) {
      KVCAL_CHECK(z[i] < kInf, "logit {} at index {} is {}", z[i], i, std::isnan(z[i]) ? "NaN" : "+inf");
    }
  }
  KVCAL_CHECK(m > -kInf, "every logit of the row is -inf");

  // Pass 2 (the row is in cache now): s, s1, s2 over x = z - m. Lanes
  // accumulate blocks of 16 vectors in float, blocks add up in double.
  double s = 0, s1 = 0, s2 = 0;
  const vf16 mvec = splat(m);
  for (std::int64_t block = 0; block < vec_end; block += 256) {
    const std::int64_t end = std::min(vec_end, block + 256);
    vf16 a0{}, a1{}, a2{};
    for (std::int64_t i = block; i < end; i += 16) {
      const vf16 x = load16(z + i) - mvec;
      const vi16 live = x > splat(kLow);
      const vf16 xl = (vf16)((vi16)x & live);
      const vf16 e = (vf16)((vi16)exp_nonpositive(xl) & live);
      a0 += e;
      a1 += e * xl;
      a2 += e * xl * xl;
    }
    for (int l = 0; l < 16; ++l) s += a0[l], s1 += a1[l], s2 += a2[l];
  }
  for (std::int64_t i = vec_end; i < v; ++i) {
    const float x = z[i] - m;
    if (x > kLow) {
      const double e = exp_nonpositive(x);
      s += e;
      s1 += e * x;
      s2 += e * x * x;
    }
  }
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
