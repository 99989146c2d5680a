// Tests of CHESS page selection (kvcal/runtime/chess.h) against independent
// computations written here: the quantile by sorting, Algorithm 1 of the CHESS
// paper transcribed literally (S' = S * active, tau = Quantile(S', 1 - rho),
// M = (S' >= tau) & active), the page / chunk / grid summaries (Eq. 1-2) and
// the anchor (Eq. 3) from scratch in double, the selection with sinks and the
// recent window, the paged-attention table, and the re-selection trigger
// against kvcal::page_stats + kvcal::triggers.
//
// The end-to-end selection tests use keys that are integer multiples of
// B * lcm(1..N_c) * lcm(1..N_g) * lcm(1..W): every summary, the anchor and every
// score are then small integers, exact in float whatever the summation order,
// so the brute-force selection must agree bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvcal/io/entropy_calibration.h"
#include "kvcal/profile/entropy.h"
#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/common.h"

namespace kvcal::runtime {
namespace {

using Mask = std::vector<std::uint8_t>;

// ------------------------------------------------------------ references

// Linear interpolation between the order statistics of the sorted values.
float ref_quantile(std::vector<float> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return static_cast<float>(static_cast<double>(v[lo]) + frac * (static_cast<double>(v[hi]) - v[lo]));
}

// One level of Algorithm 1, literally: S' = S (.) P_active; tau = Quantile(S',
// 1 - rho); M = (S' >= tau) & P_active. No parent: every unit active (line 8).
Mask ref_level(const std::vector<float>& s, const Mask* active, double rho) {
  Mask m(s.size(), 0);
  if (s.empty()) return m;
  std::vector<float> sp(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) sp[i] = s[i] * static_cast<float>(active ? (*active)[i] : 1);
  const float tau = ref_quantile(sp, 1.0 - rho);
  for (std::size_t i = 0; i < s.size(); ++i) m[i] = sp[i] >= tau && (!active || (*active)[i]);
  return m;
}

struct Hier {
  std::vector<float> gs, cs, ps;
  std::vector<std::int32_t> chunk_grid, page_chunk;
};

struct Masks {
  Mask g, c, p;
};

Masks ref_algorithm1(const Hier& h, double rg, double rc, double rp) {
  Masks m;
  m.g = ref_level(h.gs, nullptr, rg);
  Mask ac(h.cs.size());
  for (std::size_t c = 0; c < h.cs.size(); ++c) ac[c] = m.g[static_cast<std::size_t>(h.chunk_grid[c])];  // Gather
  m.c = ref_level(h.cs, &ac, rc);
  Mask ap(h.ps.size());
  for (std::size_t p = 0; p < h.ps.size(); ++p) ap[p] = m.c[static_cast<std::size_t>(h.page_chunk[p])];
  m.p = ref_level(h.ps, &ap, rp);
  return m;
}

Masks run_library(const Hier& h, double rg, double rc, double rp) {
  Masks m;
  // Fill with a sentinel: every entry must be written.
  m.g.assign(h.gs.size(), 7);
  m.c.assign(h.cs.size(), 7);
  m.p.assign(h.ps.size(), 7);
  hierarchical_select(h.gs.data(), static_cast<std::int64_t>(h.gs.size()), h.cs.data(), h.chunk_grid.data(),
                      static_cast<std::int64_t>(h.cs.size()), h.ps.data(), h.page_chunk.data(),
                      static_cast<std::int64_t>(h.ps.size()), rg, rc, rp, m.g.data(), m.c.data(), m.p.data());
  return m;
}

void expect_gated(const Hier& h, const Masks& m) {
  for (std::size_t c = 0; c < h.cs.size(); ++c)
    if (m.c[c]) {
      EXPECT_TRUE(m.g[static_cast<std::size_t>(h.chunk_grid[c])]) << "chunk " << c << " without its grid";
    }
  for (std::size_t p = 0; p < h.ps.size(); ++p)
    if (m.p[p]) {
      EXPECT_TRUE(m.c[static_cast<std::size_t>(h.page_chunk[p])]) << "page " << p << " without its chunk";
    }
  for (const auto* mask : {&m.g, &m.c, &m.p})
    for (const auto x : *mask) EXPECT_TRUE(x == 0 || x == 1);
}

// From-scratch summaries in double: page = mean of its B keys (complete pages
// only), chunk = mean of its pages, grid = mean of its chunks (Eq. 1-2).
struct Summaries {
  std::vector<std::vector<double>> page, chunk, grid;
};

Summaries ref_summaries(const std::vector<float>& keys, std::int64_t tokens, std::int64_t dim, const ChessOptions& o) {
  Summaries s;
  const std::int64_t P = tokens / o.page_size;
  for (std::int64_t p = 0; p < P; ++p) {
    std::vector<double> v(static_cast<std::size_t>(dim), 0.0);
    for (std::int64_t t = p * o.page_size; t < (p + 1) * o.page_size; ++t)
      for (std::int64_t i = 0; i < dim; ++i)
        v[static_cast<std::size_t>(i)] += keys[static_cast<std::size_t>(t * dim + i)];
    for (auto& x : v) x /= static_cast<double>(o.page_size);
    s.page.push_back(v);
  }
  const auto mean_of = [dim](const std::vector<std::vector<double>>& src, std::int64_t a, std::int64_t b) {
    std::vector<double> v(static_cast<std::size_t>(dim), 0.0);
    for (std::int64_t j = a; j < b; ++j)
      for (std::int64_t i = 0; i < dim; ++i)
        v[static_cast<std::size_t>(i)] += src[static_cast<std::size_t>(j)][static_cast<std::size_t>(i)];
    for (auto& x : v) x /= static_cast<double>(b - a);
    return v;
  };
  const std::int64_t C = (P + o.chunk_pages - 1) / o.chunk_pages;
  for (std::int64_t c = 0; c < C; ++c)
    s.chunk.push_back(mean_of(s.page, c * o.chunk_pages, std::min((c + 1) * o.chunk_pages, P)));
  const std::int64_t G = (C + o.grid_chunks - 1) / o.grid_chunks;
  for (std::int64_t g = 0; g < G; ++g)
    s.grid.push_back(mean_of(s.chunk, g * o.grid_chunks, std::min((g + 1) * o.grid_chunks, C)));
  return s;
}

std::vector<double> ref_anchor(const Summaries& s, const std::vector<float>& keys, std::int64_t tokens,
                               std::int64_t dim, const ChessOptions& o) {
  std::vector<double> a(static_cast<std::size_t>(dim), 0.0);
  const auto P = static_cast<std::int64_t>(s.page.size());
  if (P > 0) {
    const std::int64_t first = std::max<std::int64_t>(0, P - o.recent_pages);
    for (std::int64_t p = first; p < P; ++p)
      for (std::int64_t i = 0; i < dim; ++i)
        a[static_cast<std::size_t>(i)] += s.page[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)];
    for (auto& x : a) x /= static_cast<double>(P - first);
  } else {
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t i = 0; i < dim; ++i)
        a[static_cast<std::size_t>(i)] += keys[static_cast<std::size_t>(t * dim + i)];
    for (auto& x : a) x /= static_cast<double>(tokens);
  }
  return a;
}

float dot(const std::vector<double>& a, const std::vector<double>& b) {
  double acc = 0;
  for (std::size_t i = 0; i < a.size(); ++i) acc += a[i] * b[i];
  return static_cast<float>(acc);
}

// The whole selection by brute force: score every unit against the anchor,
// Algorithm 1 with the index's parent maps, then the union with the sinks and
// the last recent_pages complete pages; ascending.
std::vector<std::int32_t> ref_select(const std::vector<float>& keys, std::int64_t tokens, std::int64_t dim,
                                     const ChessOptions& o, const std::vector<double>* explicit_anchor = nullptr) {
  const Summaries s = ref_summaries(keys, tokens, dim, o);
  const auto P = static_cast<std::int64_t>(s.page.size());
  if (P == 0) return {};
  const std::vector<double> a = explicit_anchor ? *explicit_anchor : ref_anchor(s, keys, tokens, dim, o);
  Hier h;
  for (const auto& v : s.grid) h.gs.push_back(dot(a, v));
  for (std::size_t c = 0; c < s.chunk.size(); ++c) {
    h.cs.push_back(dot(a, s.chunk[c]));
    h.chunk_grid.push_back(static_cast<std::int32_t>(static_cast<std::int64_t>(c) / o.grid_chunks));
  }
  for (std::size_t p = 0; p < s.page.size(); ++p) {
    h.ps.push_back(dot(a, s.page[p]));
    h.page_chunk.push_back(static_cast<std::int32_t>(static_cast<std::int64_t>(p) / o.chunk_pages));
  }
  Mask keep = ref_algorithm1(h, o.rho_grid, o.rho_chunk, o.rho_page).p;
  for (std::int64_t p = 0; p < P; ++p)
    if (p < o.sink_pages || p >= P - o.recent_pages) keep[static_cast<std::size_t>(p)] = 1;
  std::vector<std::int32_t> out;
  for (std::int64_t p = 0; p < P; ++p)
    if (keep[static_cast<std::size_t>(p)]) out.push_back(static_cast<std::int32_t>(p));
  return out;
}

void expect_store_matches(const ChessIndex& idx, const std::vector<float>& keys, const ChessOptions& o,
                          const std::string& where) {
  const std::int64_t dim = idx.dim();
  const Summaries s = ref_summaries(keys, idx.tokens(), dim, o);
  const auto P = static_cast<std::int64_t>(s.page.size()), C = static_cast<std::int64_t>(s.chunk.size()),
             G = static_cast<std::int64_t>(s.grid.size());
  ASSERT_EQ(idx.pages(), P) << where;
  ASSERT_EQ(idx.chunks(), C) << where;
  ASSERT_EQ(idx.grids(), G) << where;
  ASSERT_EQ(idx.rows(), P + C + G) << where;
  std::vector<int> used(static_cast<std::size_t>(P + C + G), 0);
  const auto check = [&](std::int64_t row, const std::vector<double>& ref, const char* what, std::int64_t k) {
    ASSERT_GE(row, 0);
    ASSERT_LT(row, idx.rows());
    ++used[static_cast<std::size_t>(row)];
    const float* v = idx.store() + row * dim;
    for (std::int64_t i = 0; i < dim; ++i) {
      const double r = ref[static_cast<std::size_t>(i)];
      EXPECT_NEAR(v[i], r, 2e-6 * (1.0 + std::abs(r))) << where << ": " << what << " " << k << " channel " << i;
    }
  };
  for (std::int64_t p = 0; p < P; ++p) check(idx.page_row(p), s.page[static_cast<std::size_t>(p)], "page", p);
  for (std::int64_t c = 0; c < C; ++c) check(idx.chunk_row(c), s.chunk[static_cast<std::size_t>(c)], "chunk", c);
  for (std::int64_t g = 0; g < G; ++g) check(idx.grid_row(g), s.grid[static_cast<std::size_t>(g)], "grid", g);
  for (std::size_t r = 0; r < used.size(); ++r) EXPECT_EQ(used[r], 1) << where << ": row " << r;  // a bijection
}

bool same_store(const ChessIndex& a, const ChessIndex& b) {
  if (a.rows() != b.rows() || a.dim() != b.dim() || a.tokens() != b.tokens()) return false;
  for (std::int64_t p = 0; p < a.pages(); ++p)
    if (a.page_row(p) != b.page_row(p)) return false;
  const auto bytes = static_cast<std::size_t>(a.rows() * a.dim()) * sizeof(float);
  return bytes == 0 || std::memcmp(a.store(), b.store(), bytes) == 0;
}

std::int64_t lcm_upto(std::int64_t n) {
  std::int64_t l = 1;
  for (std::int64_t i = 2; i <= n; ++i) l = std::lcm(l, i);
  return l;
}

struct Ratios {
  double g, c, p;
};

Ratios random_ratios(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.01, 1.0);
  switch (std::uniform_int_distribution<int>(0, 6)(rng)) {
    case 0:
      return {0.9, 0.9, 0.9};
    case 1:
      return {0.8, 0.7, 0.7};
    case 2:
      return {0.5, 0.2, 0.1};
    case 3:
      return {1.0, 1.0, 1.0};
    case 4:
      return {1e-3, 1.0, 1e-3};
    default:
      return {u(rng), u(rng), u(rng)};
  }
}

ChessOptions exact_options(std::mt19937_64& rng) {
  ChessOptions o;
  o.page_size = std::uniform_int_distribution<int>(1, 4)(rng);
  o.chunk_pages = std::uniform_int_distribution<int>(1, 3)(rng);
  o.grid_chunks = std::uniform_int_distribution<int>(1, 3)(rng);
  o.recent_pages = std::uniform_int_distribution<int>(1, 3)(rng);
  o.sink_pages = std::uniform_int_distribution<int>(0, 3)(rng);
  const Ratios r = random_ratios(rng);
  o.rho_grid = r.g;
  o.rho_chunk = r.c;
  o.rho_page = r.p;
  return o;
}

// Keys whose summaries, anchor and scores are exact small integers (see top).
std::vector<float> exact_keys(std::mt19937_64& rng, const ChessOptions& o, std::int64_t tokens, std::int64_t dim) {
  const std::int64_t L = o.page_size * lcm_upto(o.chunk_pages) * lcm_upto(o.grid_chunks) * lcm_upto(o.recent_pages);
  std::vector<float> k(static_cast<std::size_t>(tokens * dim));
  for (auto& x : k) x = static_cast<float>(L * std::uniform_int_distribution<int>(-2, 2)(rng));
  return k;
}

void expect_selection_invariants(const std::vector<std::int32_t>& sel, const ChessIndex& idx) {
  const std::int64_t P = idx.pages();
  const ChessOptions& o = idx.options();
  EXPECT_TRUE(std::is_sorted(sel.begin(), sel.end()));
  EXPECT_TRUE(std::adjacent_find(sel.begin(), sel.end()) == sel.end());
  for (const auto p : sel) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, P);
  }
  if (P == 0) {
    EXPECT_TRUE(sel.empty());
    return;
  }
  for (std::int64_t p = 0; p < std::min(P, o.sink_pages); ++p)
    EXPECT_TRUE(std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(p))) << "sink " << p;
  for (std::int64_t p = std::max<std::int64_t>(0, P - o.recent_pages); p < P; ++p)
    EXPECT_TRUE(std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(p))) << "recent " << p;
}

// ------------------------------------------------------------ 1. quantile

TEST(RuntimeChess, QuantileMatchesSortedReference) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 500; ++trial) {
    const std::int64_t n = std::uniform_int_distribution<int>(1, 60)(rng);
    std::vector<float> v(static_cast<std::size_t>(n));
    const int mode = trial % 3;
    for (auto& x : v) {
      if (mode == 0) x = std::normal_distribution<float>(0.0f, 3.0f)(rng);
      if (mode == 1) x = static_cast<float>(std::uniform_int_distribution<int>(-2, 2)(rng));  // many ties
      if (mode == 2) x = -std::uniform_real_distribution<float>(0.0f, 1e4f)(rng);
    }
    const std::vector<float> before = v;
    for (const double q : {0.0, 1.0, 0.5, 0.1, 0.3, 0.9, 1.0 - 0.7, 1.0 - 0.9, 1.0 - 0.2,
                           std::uniform_real_distribution<double>(0.0, 1.0)(rng)}) {
      const float got = quantile(v.data(), n, q);
      EXPECT_EQ(got, ref_quantile(v, q)) << "n=" << n << " q=" << q;
      const std::vector<double> d(v.begin(), v.end());
      const double pct = kvcal::percentile(d, 100.0 * q);
      EXPECT_NEAR(got, pct, 1e-5 * (1.0 + std::abs(pct))) << "n=" << n << " q=" << q;
      EXPECT_GE(got, *std::min_element(v.begin(), v.end()));
      EXPECT_LE(got, *std::max_element(v.begin(), v.end()));
    }
    EXPECT_EQ(v, before);  // the input is not reordered
    EXPECT_EQ(quantile(v.data(), n, 0.0), *std::min_element(v.begin(), v.end()));
    EXPECT_EQ(quantile(v.data(), n, 1.0), *std::max_element(v.begin(), v.end()));
  }
}

TEST(RuntimeChess, QuantileHandCasesAndErrors) {
  const std::vector<float> one{4.5f};
  for (const double q : {0.0, 0.25, 1.0}) EXPECT_EQ(quantile(one.data(), 1, q), 4.5f);
  const std::vector<float> v{3, 1, 4, 1, 5};  // sorted 1 1 3 4 5
  EXPECT_EQ(quantile(v.data(), 5, 0.0), 1.0f);
  EXPECT_EQ(quantile(v.data(), 5, 0.25), 1.0f);   // pos 1
  EXPECT_EQ(quantile(v.data(), 5, 0.5), 3.0f);    // pos 2
  EXPECT_EQ(quantile(v.data(), 5, 0.625), 3.5f);  // pos 2.5
  EXPECT_EQ(quantile(v.data(), 5, 0.875), 4.5f);  // pos 3.5
  EXPECT_EQ(quantile(v.data(), 5, 1.0), 5.0f);
  const std::vector<float> two{10, 20};
  EXPECT_EQ(quantile(two.data(), 2, 0.3), 13.0f);
  EXPECT_THROW(quantile(v.data(), 0, 0.5), Error);
  EXPECT_THROW(quantile(nullptr, 0, 0.5), Error);
  EXPECT_THROW(quantile(v.data(), -1, 0.5), Error);
  EXPECT_THROW(quantile(v.data(), 5, -1e-9), Error);
  EXPECT_THROW(quantile(v.data(), 5, 1.0 + 1e-9), Error);
  EXPECT_THROW(quantile(v.data(), 5, std::numeric_limits<double>::quiet_NaN()), Error);
}

// ------------------------------------------------------------ 2. Algorithm 1

TEST(RuntimeChess, HierarchicalSelectHandExample) {
  // grids [1, 3], rho 0.5: tau = 1 + 0.5 * 2 = 2 -> grid 1.
  // chunks of grid 0: 0, 1; of grid 1: 2, 3. S'c = [0, 0, 2, 4], tau = 1 -> chunks 2, 3.
  // pages 4..7 active; S'p = [0 0 0 0 1 3 -1 7], sorted -1 0 0 0 0 1 3 7, pos 3.5: tau 0
  // -> pages 4 (1), 5 (3), 7 (7); page 6 (-1) is below.
  Hier h;
  h.gs = {1, 3};
  h.cs = {5, 6, 2, 4};
  h.chunk_grid = {0, 0, 1, 1};
  h.ps = {9, 9, 9, 9, 1, 3, -1, 7};
  h.page_chunk = {0, 0, 1, 1, 2, 2, 3, 3};
  const Masks m = run_library(h, 0.5, 0.5, 0.5);
  EXPECT_EQ(m.g, (Mask{0, 1}));
  EXPECT_EQ(m.c, (Mask{0, 0, 1, 1}));
  EXPECT_EQ(m.p, (Mask{0, 0, 0, 0, 1, 1, 0, 1}));
  // ratio 1 everywhere keeps everything.
  const Masks all = run_library(h, 1, 1, 1);
  EXPECT_EQ(all.g, Mask(2, 1));
  EXPECT_EQ(all.c, Mask(4, 1));
  EXPECT_EQ(all.p, Mask(8, 1));
}

TEST(RuntimeChess, HierarchicalSelectZeroesInactiveScores) {
  // Negative scores: the paper zeroes the inactive chunk's score (it is not
  // removed), which lifts the quantile. grids [2, 1], rho 0.5: tau 1.5 -> grid 0.
  // S'c = [-3, -1, 0 (inactive 5)], rho 0.5: tau = quantile 0.5 = -1 -> chunk 1 only
  // (chunk 2 passes the threshold but its grid is inactive). Removing chunk 2
  // instead would give tau = -2 and keep chunks 0 and 1.
  Hier h;
  h.gs = {2, 1};
  h.cs = {-3, -1, 5};
  h.chunk_grid = {0, 0, 1};
  h.ps = {-1, -2, -5, -4, 100};
  h.page_chunk = {0, 0, 1, 1, 2};
  // pages: active 2, 3 (chunk 1). S'p = [0 0 -5 -4 0], rho 0.5: sorted -5 -4 0 0 0, tau = 0
  // -> no active page reaches 0: the level keeps nothing.
  const Masks m = run_library(h, 0.5, 0.5, 0.5);
  EXPECT_EQ(m.g, (Mask{1, 0}));
  EXPECT_EQ(m.c, (Mask{0, 1, 0}));
  EXPECT_EQ(m.p, (Mask{0, 0, 0, 0, 0}));
  const Masks r = ref_algorithm1(h, 0.5, 0.5, 0.5);
  EXPECT_EQ(m.c, r.c);
  EXPECT_EQ(m.p, r.p);
  // rho_page 1: tau = min = -5 -> both active pages.
  EXPECT_EQ(run_library(h, 0.5, 0.5, 1.0).p, (Mask{0, 0, 1, 1, 0}));
}

Hier random_hier(std::mt19937_64& rng, int score_mode) {
  Hier h;
  const int G = std::uniform_int_distribution<int>(0, 10)(rng) == 0 ? 0 : std::uniform_int_distribution<int>(1, 6)(rng);
  const bool contiguous = std::uniform_int_distribution<int>(0, 1)(rng) == 0;
  const auto score = [&]() -> float {
    switch (score_mode) {
      case 0:
        return std::normal_distribution<float>(0.0f, 1.0f)(rng);
      case 1:
        return static_cast<float>(std::uniform_int_distribution<int>(-2, 2)(rng));  // ties
      case 2:
        return -std::uniform_real_distribution<float>(0.1f, 5.0f)(rng);  // negative
      case 3:
        return 1.5f;  // all equal
      default:
        return static_cast<float>(-std::uniform_int_distribution<int>(1, 3)(rng));  // negative ties
    }
  };
  for (int g = 0; g < G; ++g) h.gs.push_back(score());
  // No chunks at all sometimes (empty levels).
  const bool empty_below = G == 0 || std::uniform_int_distribution<int>(0, 12)(rng) == 0;
  if (!empty_below) {
    for (int g = 0; g < G; ++g) {
      const int nc = std::uniform_int_distribution<int>(0, 4)(rng);
      for (int c = 0; c < nc; ++c) {
        h.cs.push_back(score());
        h.chunk_grid.push_back(contiguous ? g : std::uniform_int_distribution<int>(0, G - 1)(rng));
      }
    }
    const auto C = static_cast<int>(h.cs.size());
    const bool no_pages = C == 0 || std::uniform_int_distribution<int>(0, 12)(rng) == 0;
    if (!no_pages)
      for (int c = 0; c < C; ++c) {
        const int np = std::uniform_int_distribution<int>(0, 5)(rng);
        for (int p = 0; p < np; ++p) {
          h.ps.push_back(score());
          h.page_chunk.push_back(contiguous ? c : std::uniform_int_distribution<int>(0, C - 1)(rng));
        }
      }
  }
  return h;
}

TEST(RuntimeChess, HierarchicalSelectMatchesBruteForce) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 3000; ++trial) {
    const Hier h = random_hier(rng, trial % 5);
    const Ratios r = random_ratios(rng);
    const Masks got = run_library(h, r.g, r.c, r.p);
    const Masks ref = ref_algorithm1(h, r.g, r.c, r.p);
    EXPECT_EQ(got.g, ref.g) << "trial " << trial;
    EXPECT_EQ(got.c, ref.c) << "trial " << trial;
    EXPECT_EQ(got.p, ref.p) << "trial " << trial;
    expect_gated(h, got);
    if (!h.gs.empty()) {
      EXPECT_GE(std::count(got.g.begin(), got.g.end(), 1), 1);  // the best grid always passes
    }
    if (r.g == 1.0 && r.c == 1.0 && r.p == 1.0) {
      EXPECT_EQ(got.g, Mask(h.gs.size(), 1));
      EXPECT_EQ(got.c, Mask(h.cs.size(), 1));
      EXPECT_EQ(got.p, Mask(h.ps.size(), 1));
    }
  }
}

TEST(RuntimeChess, HierarchicalSelectSingleGridAndEmptyLevels) {
  // A single grid: always selected, whatever rho_grid.
  Hier h;
  h.gs = {-4};
  h.cs = {1, 2, 3, 4};
  h.chunk_grid = {0, 0, 0, 0};
  h.ps = {4, 3, 2, 1, 0, -1, -2, -3};
  h.page_chunk = {0, 0, 1, 1, 2, 2, 3, 3};
  for (const double rg : {1e-3, 0.5, 1.0}) {
    const Masks m = run_library(h, rg, 0.5, 0.5);
    EXPECT_EQ(m.g, Mask{1});
    const Masks r = ref_algorithm1(h, rg, 0.5, 0.5);
    EXPECT_EQ(m.c, r.c);
    EXPECT_EQ(m.p, r.p);
    expect_gated(h, m);
  }
  // chunks 2, 3 (sorted 1 2 3 4, pos 1.5: tau = 2.5); pages 4..7: S' = [0 0 0 0 0 -1 -2 -3],
  // tau (pos 3.5) = 0 -> page 4 only.
  EXPECT_EQ(run_library(h, 0.5, 0.5, 0.5).c, (Mask{0, 0, 1, 1}));
  EXPECT_EQ(run_library(h, 0.5, 0.5, 0.5).p, (Mask{0, 0, 0, 0, 1, 0, 0, 0}));
  // Empty levels.
  Hier none;
  EXPECT_NO_THROW(run_library(none, 0.5, 0.5, 0.5));
  Hier grids_only;
  grids_only.gs = {1, 2, 3};
  EXPECT_EQ(run_library(grids_only, 0.5, 0.5, 0.5).g, (Mask{0, 1, 1}));  // tau = 2
  Hier no_pages = h;
  no_pages.ps.clear();
  no_pages.page_chunk.clear();
  const Masks m = run_library(no_pages, 0.5, 0.5, 0.5);
  EXPECT_EQ(m.c, (Mask{0, 0, 1, 1}));
  EXPECT_TRUE(m.p.empty());
}

TEST(RuntimeChess, HierarchicalSelectErrors) {
  Hier h;
  h.gs = {1, 2};
  h.cs = {1, 2};
  h.chunk_grid = {0, 1};
  h.ps = {1, 2};
  h.page_chunk = {0, 1};
  EXPECT_NO_THROW(run_library(h, 0.5, 0.5, 0.5));
  for (const double bad : {0.0, -0.1, 1.0001, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THROW(run_library(h, bad, 0.5, 0.5), Error) << bad;
    EXPECT_THROW(run_library(h, 0.5, bad, 0.5), Error) << bad;
    EXPECT_THROW(run_library(h, 0.5, 0.5, bad), Error) << bad;
  }
  Hier bad_chunk = h;
  bad_chunk.chunk_grid[1] = 2;
  EXPECT_THROW(run_library(bad_chunk, 0.5, 0.5, 0.5), Error);
  bad_chunk.chunk_grid[1] = -1;
  EXPECT_THROW(run_library(bad_chunk, 0.5, 0.5, 0.5), Error);
  Hier bad_page = h;
  bad_page.page_chunk[0] = 2;
  EXPECT_THROW(run_library(bad_page, 0.5, 0.5, 0.5), Error);
  bad_page.page_chunk[0] = -3;
  EXPECT_THROW(run_library(bad_page, 0.5, 0.5, 0.5), Error);
}

// ------------------------------------------------------------ 3. summaries

TEST(RuntimeChess, SummariesAfterEveryToken) {
  std::mt19937_64 rng(3);
  struct Shape {
    std::int64_t B, Nc, Ng, dim, tokens;
  };
  for (const Shape sh : {Shape{3, 2, 2, 5, 47}, Shape{1, 1, 1, 2, 9}, Shape{2, 3, 2, 3, 41}, Shape{4, 2, 3, 4, 61},
                         Shape{5, 1, 4, 1, 33}}) {
    ChessOptions o;
    o.page_size = sh.B;
    o.chunk_pages = sh.Nc;
    o.grid_chunks = sh.Ng;
    ChessIndex idx(sh.dim, o);
    EXPECT_EQ(idx.dim(), sh.dim);
    EXPECT_EQ(idx.rows(), 0);
    std::vector<float> keys;
    for (std::int64_t t = 0; t < sh.tokens; ++t) {
      std::vector<float> k(static_cast<std::size_t>(sh.dim));
      for (auto& x : k) x = std::normal_distribution<float>(0.5f, 2.0f)(rng);
      keys.insert(keys.end(), k.begin(), k.end());
      idx.append(k.data(), 1, sh.dim);
      EXPECT_EQ(idx.tokens(), t + 1);
      EXPECT_EQ(idx.pages(), (t + 1) / sh.B);
      EXPECT_EQ(idx.chunks(), (idx.pages() + sh.Nc - 1) / sh.Nc);
      EXPECT_EQ(idx.grids(), (idx.chunks() + sh.Ng - 1) / sh.Ng);
      expect_store_matches(idx, keys, o, "B=" + std::to_string(sh.B) + " token " + std::to_string(t + 1));
    }
    EXPECT_THROW(idx.page_row(-1), Error);
    EXPECT_THROW(idx.page_row(idx.pages()), Error);
    EXPECT_THROW(idx.chunk_row(idx.chunks()), Error);
    EXPECT_THROW(idx.grid_row(idx.grids()), Error);
  }
}

TEST(RuntimeChess, AppendBatchingAndStride) {
  std::mt19937_64 rng(4);
  ChessOptions o;
  o.page_size = 3;
  o.chunk_pages = 2;
  o.grid_chunks = 2;
  const std::int64_t dim = 6, n = 53, stride = dim + 3;
  std::vector<float> keys(static_cast<std::size_t>(n * dim));
  for (auto& x : keys) x = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
  // Padded copy: the padding holds NaN, which must never be read.
  std::vector<float> padded(static_cast<std::size_t>(n * stride), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t t = 0; t < n; ++t) std::copy_n(keys.begin() + t * dim, dim, padded.begin() + t * stride);

  ChessIndex one(dim, o), each(dim, o), pieces(dim, o), strided(dim, o);
  one.append(keys.data(), n, dim);
  for (std::int64_t t = 0; t < n; ++t) each.append(keys.data() + t * dim, 1, dim);
  for (std::int64_t t = 0; t < n;) {
    const std::int64_t k = std::min<std::int64_t>(n - t, std::uniform_int_distribution<int>(0, 7)(rng));
    pieces.append(keys.data() + t * dim, k, dim);
    t += k;
  }
  strided.append(padded.data(), n, stride);
  EXPECT_TRUE(same_store(one, each));
  EXPECT_TRUE(same_store(one, pieces));
  EXPECT_TRUE(same_store(one, strided));
  expect_store_matches(one, keys, o, "one call");
  EXPECT_EQ(one.anchor(), each.anchor());
  EXPECT_EQ(one.select(), each.select());
  // n = 0 is a no-op.
  one.append(keys.data(), 0, dim);
  EXPECT_TRUE(same_store(one, each));
}

TEST(RuntimeChess, Fp16AppendEqualsFloatAppendOfConvertedValues) {
  std::mt19937_64 rng(5);
  ChessOptions o;
  o.page_size = 3;
  o.chunk_pages = 2;
  o.grid_chunks = 2;
  const std::int64_t dim = 7, n = 38;
  std::vector<half_bits> h(static_cast<std::size_t>(n * dim));
  for (auto& x : h) x = float_to_half(std::normal_distribution<float>(0.0f, 4.0f)(rng));
  h[3] = 0x0001;  // a subnormal
  h[4] = 0x8000;  // -0
  h[5] = 0x7bff;  // 65504
  std::vector<float> f(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(h[i]);
  ChessIndex a(dim, o), b(dim, o), c(dim, o);
  a.append(h.data(), n, dim);
  b.append(f.data(), n, dim);
  EXPECT_TRUE(same_store(a, b));
  // strided binary16 with NaN padding
  const std::int64_t stride = dim + 2;
  std::vector<half_bits> hp(static_cast<std::size_t>(n * stride), 0x7e00);
  for (std::int64_t t = 0; t < n; ++t) std::copy_n(h.begin() + t * dim, dim, hp.begin() + t * stride);
  c.append(hp.data(), n, stride);
  EXPECT_TRUE(same_store(a, c));
  expect_store_matches(a, f, o, "fp16");
}

TEST(RuntimeChess, NonFiniteKeysThrowAndLeaveTheIndexUnchanged) {
  ChessOptions o;
  o.page_size = 2;
  o.chunk_pages = 2;
  o.grid_chunks = 2;
  const std::int64_t dim = 3;
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    ChessIndex idx(dim, o);
    std::vector<float> keys(5 * dim, 1.0f);
    idx.append(keys.data(), 3, dim);
    ChessIndex ref(dim, o);
    ref.append(keys.data(), 3, dim);
    keys[4 * dim + 1] = bad;  // the last of 5 tokens
    EXPECT_THROW(idx.append(keys.data(), 5, dim), Error);
    EXPECT_TRUE(same_store(idx, ref));  // nothing of the batch was added
    EXPECT_EQ(idx.tokens(), 3);
    EXPECT_THROW(idx.append(keys.data() + 4 * dim, 1, dim), Error);
    EXPECT_EQ(idx.tokens(), 3);
    const half_bits hb = float_to_half(bad);
    std::vector<half_bits> h(dim, float_to_half(1.0f));
    h[2] = hb;
    EXPECT_THROW(idx.append(h.data(), 1, dim), Error);
    EXPECT_EQ(idx.tokens(), 3);
  }
  ChessIndex idx(dim, o);
  const std::vector<float> keys(4 * dim, 1.0f);
  EXPECT_THROW(idx.append(keys.data(), -1, dim), Error);
  EXPECT_THROW(idx.append(keys.data(), 2, dim - 1), Error);  // stride < dim
  EXPECT_EQ(idx.tokens(), 0);
}

// The binary16 overload is documented as "the same" as the float one, which
// validates the whole batch (count, stride, finiteness) before adding anything.
TEST(RuntimeChess, Fp16AppendValidatesLikeFloat) {
  ChessOptions o;
  o.page_size = 2;
  const std::int64_t dim = 3;
  std::vector<half_bits> h(4 * dim, float_to_half(1.0f));
  {
    ChessIndex idx(dim, o);
    EXPECT_THROW(idx.append(h.data(), -1, dim), Error) << "negative token count";
    EXPECT_EQ(idx.tokens(), 0);
  }
  {
    ChessIndex idx(dim, o);
    EXPECT_THROW(idx.append(h.data(), 2, dim - 1), Error) << "stride < dim (overlapping rows)";
    EXPECT_EQ(idx.tokens(), 0);
  }
  {
    ChessIndex idx(dim, o);
    h[3 * dim + 1] = 0x7e00;  // NaN in the last of 4 tokens
    EXPECT_THROW(idx.append(h.data(), 4, dim), Error);
    EXPECT_EQ(idx.tokens(), 0) << "a rejected binary16 batch must not be partly appended";
    EXPECT_EQ(idx.pages(), 0);
    EXPECT_EQ(idx.rows(), 0);
  }
}

TEST(RuntimeChess, ConstructorValidates) {
  EXPECT_THROW(ChessIndex(0, ChessOptions{}), Error);
  EXPECT_THROW(ChessIndex(-4, ChessOptions{}), Error);
  EXPECT_THROW(ChessIndex((std::int64_t{1} << 24) + 1, ChessOptions{}), Error);
  ChessOptions bad;
  bad.page_size = 0;
  EXPECT_THROW(ChessIndex(4, bad), Error);
  ChessIndex ok(4, ChessOptions{});
  EXPECT_EQ(ok.options().page_size, 32);
  EXPECT_EQ(ok.tokens(), 0);
  EXPECT_EQ(ok.pages(), 0);
  EXPECT_TRUE(ok.select().empty());
  // moves keep the state
  const std::vector<float> k(4 * 40, 0.5f);
  ok.append(k.data(), 40, 4);
  ChessIndex moved(std::move(ok));
  EXPECT_EQ(moved.tokens(), 40);
  EXPECT_EQ(moved.pages(), 1);
}

// ------------------------------------------------------------ 4. anchor

TEST(RuntimeChess, AnchorIsMeanOfRecentPages) {
  std::mt19937_64 rng(6);
  for (const std::int64_t recent : {1, 2, 3}) {
    ChessOptions o;
    o.page_size = 3;
    o.chunk_pages = 2;
    o.grid_chunks = 2;
    o.recent_pages = recent;
    const std::int64_t dim = 4;
    ChessIndex idx(dim, o);
    EXPECT_THROW(idx.anchor(), Error);  // no tokens
    std::vector<float> keys;
    for (std::int64_t t = 0; t < 20; ++t) {
      std::vector<float> k(static_cast<std::size_t>(dim));
      for (auto& x : k) x = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
      keys.insert(keys.end(), k.begin(), k.end());
      idx.append(k.data(), 1, dim);
      const Summaries s = ref_summaries(keys, t + 1, dim, o);
      const std::vector<double> ref = ref_anchor(s, keys, t + 1, dim, o);
      // Explicitly: pages [max(0, P - W), P), else the partial page's tokens.
      const std::int64_t P = (t + 1) / 3;
      std::vector<double> hand(static_cast<std::size_t>(dim), 0.0);
      const std::int64_t first_tok = P > 0 ? std::max<std::int64_t>(0, P - recent) * 3 : 0;
      const std::int64_t end_tok = P > 0 ? P * 3 : t + 1;
      for (std::int64_t u = first_tok; u < end_tok; ++u)
        for (std::int64_t i = 0; i < dim; ++i)
          hand[static_cast<std::size_t>(i)] += keys[static_cast<std::size_t>(u * dim + i)];
      for (auto& x : hand) x /= static_cast<double>(end_tok - first_tok);
      const std::vector<float> a = idx.anchor();
      ASSERT_EQ(static_cast<std::int64_t>(a.size()), dim);
      for (std::int64_t i = 0; i < dim; ++i) {
        EXPECT_NEAR(a[static_cast<std::size_t>(i)], ref[static_cast<std::size_t>(i)], 1e-5) << "token " << t + 1;
        EXPECT_NEAR(a[static_cast<std::size_t>(i)], hand[static_cast<std::size_t>(i)], 1e-5) << "token " << t + 1;
      }
    }
  }
}

// ------------------------------------------------------------ 5. select

TEST(RuntimeChess, SelectMatchesBruteForceExactly) {
  std::mt19937_64 rng(7);
  const std::int64_t dim = 3;
  for (int trial = 0; trial < 120; ++trial) {
    const ChessOptions o = exact_options(rng);
    const std::int64_t n = std::uniform_int_distribution<int>(
        0, static_cast<int>(o.page_size * o.chunk_pages * o.grid_chunks * 4 + o.page_size))(rng);
    const std::vector<float> keys = exact_keys(rng, o, n, dim);
    ChessIndex idx(dim, o);
    for (std::int64_t t = 0; t < n; ++t) {
      idx.append(keys.data() + t * dim, 1, dim);
      const std::vector<std::int32_t> got = idx.select();
      EXPECT_EQ(got, ref_select(keys, t + 1, dim, o))
          << "trial " << trial << " tokens " << t + 1 << " B " << o.page_size << " Nc " << o.chunk_pages << " Ng "
          << o.grid_chunks << " rho " << o.rho_grid << "/" << o.rho_chunk << "/" << o.rho_page;
      expect_selection_invariants(got, idx);
    }
    // With an explicit anchor.
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<float> a(dim);
      std::vector<double> ad(dim);
      for (std::int64_t i = 0; i < dim; ++i)
        a[static_cast<std::size_t>(i)] = static_cast<float>(std::uniform_int_distribution<int>(-3, 3)(rng)),
        ad[static_cast<std::size_t>(i)] = a[static_cast<std::size_t>(i)];
      const std::vector<std::int32_t> got = idx.select(a.data());
      EXPECT_EQ(got, ref_select(keys, n, dim, o, &ad)) << "trial " << trial << " explicit anchor";
      expect_selection_invariants(got, idx);
    }
    // select() is select(anchor()).
    if (idx.pages() > 0) {
      EXPECT_EQ(idx.select(), idx.select(idx.anchor().data()));
    }
  }
}

TEST(RuntimeChess, SelectHandExample) {
  // dim 1, B = 1, N_c = 2, N_g = 2, one sink, one recent page. Keys (= page
  // vectors) 5, -1, 2, 4, 0, 3, 1: chunks [5,-1] [2,4] [0,3] [1] -> 2, 3, 1.5, 1;
  // grids (2 + 3) / 2 = 2.5, (1.5 + 1) / 2 = 1.25. Anchor = last page = 1, so
  // scores equal the vectors.
  ChessOptions o;
  o.page_size = 1;
  o.chunk_pages = 2;
  o.grid_chunks = 2;
  o.sink_pages = 1;
  o.recent_pages = 1;
  o.rho_grid = 0.5;   // tau = 1.25 + 0.5 * 1.25 = 1.875 -> grid 0
  o.rho_chunk = 0.5;  // S'c = [2, 3, 0, 0], tau = quantile 0.5 = 1 -> chunks 0, 1
  o.rho_page = 0.5;   // S'p = [5, -1, 2, 4, 0, 0, 0], sorted -1 0 0 0 2 4 5, tau 0 -> pages 0, 2, 3
  ChessIndex idx(1, o);
  const std::vector<float> keys{5, -1, 2, 4, 0, 3, 1};
  idx.append(keys.data(), 7, 1);
  EXPECT_EQ(idx.anchor(), std::vector<float>{1.0f});
  // pages 0, 2, 3 by Algorithm 1, page 0 the sink, page 6 the recent one.
  EXPECT_EQ(idx.select(), (std::vector<std::int32_t>{0, 2, 3, 6}));
  EXPECT_EQ(idx.select(), ref_select(keys, 7, 1, o));
  // Anchor -1 flips every score: grids [-2.5, -1.25] -> grid 1; chunks S' = [0, 0, -1.5, -1],
  // tau = quantile 0.5 = -0.5 -> none of the active chunks: only sink + recent remain.
  const float neg = -1.0f;
  EXPECT_EQ(idx.select(&neg), (std::vector<std::int32_t>{0, 6}));
}

TEST(RuntimeChess, SelectEmptyWithoutCompletePages) {
  ChessOptions o;
  o.page_size = 4;
  ChessIndex idx(2, o);
  const float a[2] = {1, 1};
  EXPECT_TRUE(idx.select().empty());
  EXPECT_TRUE(idx.select(a).empty());
  const std::vector<float> keys(6, 1.0f);
  idx.append(keys.data(), 3, 2);
  EXPECT_TRUE(idx.select().empty());
  EXPECT_TRUE(idx.select(a).empty());
  EXPECT_NO_THROW(idx.anchor());
}

TEST(RuntimeChess, SelectRealKeysInvariantsAndFullRetention) {
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 40; ++trial) {
    ChessOptions o;
    o.page_size = std::uniform_int_distribution<int>(1, 6)(rng);
    o.chunk_pages = std::uniform_int_distribution<int>(1, 5)(rng);
    o.grid_chunks = std::uniform_int_distribution<int>(1, 5)(rng);
    o.sink_pages = std::uniform_int_distribution<int>(0, 3)(rng);
    o.recent_pages = std::uniform_int_distribution<int>(1, 4)(rng);
    const Ratios r = random_ratios(rng);
    o.rho_grid = r.g, o.rho_chunk = r.c, o.rho_page = r.p;
    const std::int64_t dim = std::uniform_int_distribution<int>(1, 16)(rng);
    const std::int64_t n = std::uniform_int_distribution<int>(0, 300)(rng);
    std::vector<float> keys(static_cast<std::size_t>(n * dim));
    for (auto& x : keys) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    ChessIndex idx(dim, o);
    idx.append(keys.data(), n, dim);
    const auto sel = idx.select();
    expect_selection_invariants(sel, idx);
    ChessOptions all = o;
    all.rho_grid = all.rho_chunk = all.rho_page = 1.0;
    ChessIndex full(dim, all);
    full.append(keys.data(), n, dim);
    std::vector<std::int32_t> every(static_cast<std::size_t>(full.pages()));
    std::iota(every.begin(), every.end(), 0);
    EXPECT_EQ(full.select(), every);
    // the selection is a superset of the retention-1 selection's sinks/recent and a subset of all pages
    EXPECT_TRUE(std::includes(every.begin(), every.end(), sel.begin(), sel.end()));
  }
}

TEST(RuntimeChess, SelectBatchPageTable) {
  std::mt19937_64 rng(9);
  ChessOptions o;
  o.page_size = 4;
  o.chunk_pages = 2;
  o.grid_chunks = 2;
  o.sink_pages = 1;
  o.recent_pages = 1;
  o.rho_grid = o.rho_chunk = o.rho_page = 0.5;
  const std::int64_t dim = 3;
  const std::vector<std::int64_t> lengths{30, 32, 3, 0, 9, 4, 1};
  std::vector<ChessIndex> idx;
  std::vector<std::vector<float>> keys;
  for (const auto n : lengths) {
    keys.push_back(exact_keys(rng, o, n, dim));
    idx.emplace_back(dim, o);
    idx.back().append(keys.back().data(), n, dim);
  }
  std::vector<const ChessIndex*> req;
  for (const auto& x : idx) req.push_back(&x);
  const PageTable t = select_batch(req);
  ASSERT_EQ(t.indptr.size(), lengths.size() + 1);
  ASSERT_EQ(t.last_page_len.size(), lengths.size());
  EXPECT_EQ(t.indptr[0], 0);
  std::vector<std::int32_t> indices;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    const std::int64_t n = lengths[r];
    std::vector<std::int32_t> expect = ref_select(keys[r], n, dim, o);
    const std::int64_t full_pages = n / 4, partial = n % 4;
    if (partial > 0) expect.push_back(static_cast<std::int32_t>(full_pages));  // the partial page, last
    const std::vector<std::int32_t> got(t.indices.begin() + t.indptr[r], t.indices.begin() + t.indptr[r + 1]);
    EXPECT_EQ(got, expect) << "request " << r;
    const std::int32_t last = expect.empty() ? 0 : static_cast<std::int32_t>(partial > 0 ? partial : 4);
    EXPECT_EQ(t.last_page_len[r], last) << "request " << r;
    indices.insert(indices.end(), expect.begin(), expect.end());
  }
  EXPECT_EQ(t.indices, indices);
  // By hand: 30 tokens -> 7 pages + 2 tokens: last entry page 7, 2 valid tokens.
  EXPECT_EQ(t.indices[static_cast<std::size_t>(t.indptr[1] - 1)], 7);
  EXPECT_EQ(t.last_page_len[0], 2);
  // 32 tokens -> exactly 8 pages: last listed page 7 (recent), full.
  EXPECT_EQ(t.indices[static_cast<std::size_t>(t.indptr[2] - 1)], 7);
  EXPECT_EQ(t.last_page_len[1], 4);
  // 3 tokens: only the partial page 0.
  EXPECT_EQ(t.indptr[3] - t.indptr[2], 1);
  EXPECT_EQ(t.indices[static_cast<std::size_t>(t.indptr[2])], 0);
  EXPECT_EQ(t.last_page_len[2], 3);
  // 0 tokens: nothing.
  EXPECT_EQ(t.indptr[4], t.indptr[3]);
  EXPECT_EQ(t.last_page_len[3], 0);
  // 4 tokens: one full page.
  EXPECT_EQ(t.indptr[6] - t.indptr[5], 1);
  EXPECT_EQ(t.last_page_len[5], 4);

  const PageTable empty = select_batch({});
  EXPECT_EQ(empty.indptr, std::vector<std::int32_t>{0});
  EXPECT_TRUE(empty.indices.empty());
  EXPECT_TRUE(empty.last_page_len.empty());
  EXPECT_THROW(select_batch({&idx[0], nullptr}), Error);
}

// ------------------------------------------------------------ 6. options

TEST(RuntimeChess, PresetsAndOptionChecks) {
  ChessOptions base;
  base.page_size = 16;
  base.chunk_pages = 8;
  base.grid_chunks = 3;
  base.sink_pages = 2;
  base.recent_pages = 5;
  const ChessOptions c = chess_preset("conservative", base);
  EXPECT_EQ(c.rho_grid, 0.9);
  EXPECT_EQ(c.rho_chunk, 0.9);
  EXPECT_EQ(c.rho_page, 0.9);
  const ChessOptions m = chess_preset("moderate", base);
  EXPECT_EQ(m.rho_grid, 0.8);
  EXPECT_EQ(m.rho_chunk, 0.7);
  EXPECT_EQ(m.rho_page, 0.7);
  const ChessOptions a = chess_preset("aggressive", base);
  EXPECT_EQ(a.rho_grid, 0.5);
  EXPECT_EQ(a.rho_chunk, 0.2);
  EXPECT_EQ(a.rho_page, 0.1);
  for (const ChessOptions& o : {c, m, a}) {  // the rest comes from base
    EXPECT_EQ(o.page_size, 16);
    EXPECT_EQ(o.chunk_pages, 8);
    EXPECT_EQ(o.grid_chunks, 3);
    EXPECT_EQ(o.sink_pages, 2);
    EXPECT_EQ(o.recent_pages, 5);
    EXPECT_NO_THROW(check_options(o));
  }
  const ChessOptions d{};  // the defaults are "moderate"
  EXPECT_EQ(d.rho_grid, 0.8);
  EXPECT_EQ(d.rho_chunk, 0.7);
  EXPECT_EQ(d.rho_page, 0.7);
  EXPECT_EQ(chess_preset("moderate").page_size, 32);
  for (const char* bad : {"Moderate", "", "fast", "aggressive "}) EXPECT_THROW(chess_preset(bad), Error) << bad;
  EXPECT_THROW(chess_preset(nullptr), Error);

  EXPECT_NO_THROW(check_options(ChessOptions{}));
  const auto rejects = [](auto mutate) {
    ChessOptions o;
    mutate(o);
    EXPECT_THROW(check_options(o), Error);
    EXPECT_THROW(ChessIndex(4, o), Error);
  };
  rejects([](ChessOptions& o) { o.page_size = 0; });
  rejects([](ChessOptions& o) { o.page_size = -1; });
  rejects([](ChessOptions& o) { o.page_size = (1 << 20) + 1; });
  rejects([](ChessOptions& o) { o.chunk_pages = 0; });
  rejects([](ChessOptions& o) { o.grid_chunks = 0; });
  rejects([](ChessOptions& o) { o.rho_grid = 0; });
  rejects([](ChessOptions& o) { o.rho_chunk = 1.01; });
  rejects([](ChessOptions& o) { o.rho_page = -0.5; });
  rejects([](ChessOptions& o) { o.rho_page = std::numeric_limits<double>::quiet_NaN(); });
  rejects([](ChessOptions& o) { o.rho_grid = std::numeric_limits<double>::infinity(); });
  rejects([](ChessOptions& o) { o.sink_pages = -1; });
  rejects([](ChessOptions& o) { o.recent_pages = 0; });
  ChessOptions edge;
  edge.page_size = 1 << 20;
  edge.sink_pages = 0;
  edge.recent_pages = 1;
  edge.rho_grid = edge.rho_chunk = edge.rho_page = 1.0;
  EXPECT_NO_THROW(check_options(edge));
  edge.page_size = 1;
  EXPECT_NO_THROW(check_options(edge));
}

// ------------------------------------------------------------ 7. trigger

struct Page {
  std::vector<double> h, v;
};

TEST(RuntimeChess, TriggerHandPages) {
  // page size 4; thresholds entropy 1, varentropy 0.5. Expected outcomes per
  // (rule_both, temporal): {both/mean, either/mean, both/temporal, either/temporal}.
  const std::vector<Page> pages{
      {{2, 2, 2, 2}, {1, 1, 1, 1}},              // H 2, V 1, temporal 0
      {{1, 1, 1, 1}, {0.5, 0.5, 0.5, 0.5}},      // exactly at both thresholds
      {{0, 2, 0, 2}, {0, 0, 0, 0}},              // H 1 (= threshold), temporal 1
      {{0, 4, 0, 4}, {0.25, 0.25, 0.25, 0.25}},  // H 2, V 0.25, temporal 4
      {{0.5, 0.5, 0.5, 0.5}, {3, 3, 3, 3}},      // H 0.5, V 3, temporal 0
  };
  const std::vector<std::vector<bool>> expect{{true, true, false, true},
                                              {false, false, false, false},
                                              {false, false, false, true},
                                              {false, true, true, true},
                                              {false, true, false, false}};
  for (int mode = 0; mode < 4; ++mode) {
    EntropyRule rule;
    rule.entropy_threshold = 1.0;
    rule.varentropy_threshold = 0.5;
    rule.rule_both = mode % 2 == 0;
    rule.varentropy_temporal = mode >= 2;
    rule.page_size = 4;
    ReselectionTrigger trig(rule);
    EXPECT_EQ(trig.rule().page_size, 4);
    std::int64_t fired = 0;
    for (std::size_t p = 0; p < pages.size(); ++p) {
      for (int i = 0; i < 4; ++i) {
        const bool r = trig.push(pages[p].h[static_cast<std::size_t>(i)], pages[p].v[static_cast<std::size_t>(i)]);
        if (i < 3) {
          EXPECT_FALSE(r) << "mid-page, mode " << mode;
        } else {
          EXPECT_EQ(r, expect[p][static_cast<std::size_t>(mode)]) << "page " << p << " mode " << mode;
          fired += r;
        }
      }
      EXPECT_EQ(trig.pages(), static_cast<std::int64_t>(p + 1));
      EXPECT_EQ(trig.triggered(), fired);
    }
    // A partial page never fires, however high.
    EXPECT_FALSE(trig.push(100, 100));
    EXPECT_FALSE(trig.push(100, 100));
    EXPECT_EQ(trig.pages(), 5);
  }
}

TEST(RuntimeChess, TriggerUnitBits) {
  const double ln2 = std::log(2.0);
  EntropyRule rule;
  rule.entropy_threshold = 2.0;     // bits
  rule.varentropy_threshold = 3.0;  // bits^2
  rule.page_size = 2;
  rule.unit_bits = true;
  ReselectionTrigger bits(rule);
  // 2.5 bits, 3.5 bits^2 (given in nats): fires.
  EXPECT_FALSE(bits.push(2.5 * ln2, 3.5 * ln2 * ln2));
  EXPECT_TRUE(bits.push(2.5 * ln2, 3.5 * ln2 * ln2));
  // 2.5 bits but 2.9 bits^2: no.
  bits.push(2.5 * ln2, 2.9 * ln2 * ln2);
  EXPECT_FALSE(bits.push(2.5 * ln2, 2.9 * ln2 * ln2));
  // 1.9 bits, 10 bits^2: no.
  bits.push(1.9 * ln2, 10 * ln2 * ln2);
  EXPECT_FALSE(bits.push(1.9 * ln2, 10 * ln2 * ln2));
  // The same statistics read as nats against the same numbers: 2.5 ln2 = 1.73 < 2.
  rule.unit_bits = false;
  ReselectionTrigger nats(rule);
  nats.push(2.5 * ln2, 3.5 * ln2 * ln2);
  EXPECT_FALSE(nats.push(2.5 * ln2, 3.5 * ln2 * ln2));
  // Temporal varentropy in bits: entropies 0, 2, 0, 2 bits -> variance 1 bit^2 (= ln2^2 nats^2).
  for (const double thr : {0.99, 1.01}) {
    EntropyRule t;
    t.entropy_threshold = -1;
    t.varentropy_threshold = thr;
    t.varentropy_temporal = true;
    t.unit_bits = true;
    t.page_size = 4;
    ReselectionTrigger trig(t);
    trig.push(0, 0);
    trig.push(2 * ln2, 0);
    trig.push(0, 0);
    EXPECT_EQ(trig.push(2 * ln2, 0), thr < 1.0) << thr;
    // and in nats the variance is ln2^2 = 0.48: below both thresholds.
    t.unit_bits = false;
    ReselectionTrigger n(t);
    n.push(0, 0);
    n.push(2 * ln2, 0);
    n.push(0, 0);
    EXPECT_FALSE(n.push(2 * ln2, 0));
  }
}

TEST(RuntimeChess, TriggerAgreesWithOfflinePageStats) {
  std::mt19937_64 rng(10);
  const double ln2 = std::log(2.0);
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t B = std::uniform_int_distribution<int>(1, 9)(rng);
    const int n = std::uniform_int_distribution<int>(0, 200)(rng);
    std::vector<double> h(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      h[static_cast<std::size_t>(i)] = std::uniform_real_distribution<double>(0.0, 5.0)(rng);
      v[static_cast<std::size_t>(i)] = std::uniform_real_distribution<double>(0.0, 8.0)(rng);
    }
    const bool both = trial % 2 == 0, temporal = (trial / 2) % 2 == 1, bits = (trial / 4) % 2 == 1;
    // Offline reference on the token statistics in the rule's unit.
    std::vector<double> hu = h, vu = v;
    if (bits) {
      for (auto& x : hu) x /= ln2;
      for (auto& x : vu) x /= ln2 * ln2;
    }
    kvcal::PageOptions po;
    po.page_size = B;
    po.varentropy = temporal ? kvcal::PageVarentropy::temporal : kvcal::PageVarentropy::mean;
    po.keep_partial = false;
    std::vector<double> pe, pv;
    kvcal::page_stats(hu, vu, po, pe, pv);
    ASSERT_EQ(static_cast<std::int64_t>(pe.size()), n / B);
    // Thresholds at a percentile of the page values: often exactly one of them.
    EntropyRule rule;
    rule.page_size = B;
    rule.rule_both = both;
    rule.varentropy_temporal = temporal;
    rule.unit_bits = bits;
    const double q = std::vector<double>{0, 50, 100, 90, 25}[static_cast<std::size_t>(trial % 5)];
    rule.entropy_threshold = pe.empty() ? 2.0 : kvcal::percentile(pe, q);
    rule.varentropy_threshold = pv.empty() ? 2.0 : kvcal::percentile(pv, 100 - q);
    const auto tr = both ? kvcal::TriggerRule::both : kvcal::TriggerRule::either;
    ReselectionTrigger trig(rule);
    std::int64_t fired = 0;
    for (int i = 0; i < n; ++i) {
      const bool got = trig.push(h[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(i)]);
      bool expect = false;
      if ((i + 1) % B == 0) {
        const auto p = static_cast<std::size_t>((i + 1) / B - 1);
        expect = kvcal::triggers(pe[p], pv[p], rule.entropy_threshold, rule.varentropy_threshold, tr);
      }
      EXPECT_EQ(got, expect) << "trial " << trial << " token " << i;
      fired += expect;
    }
    EXPECT_EQ(trig.pages(), n / B);
    EXPECT_EQ(trig.triggered(), fired);
  }
}

TEST(RuntimeChess, TriggerErrors) {
  EntropyRule rule;
  rule.page_size = 0;
  EXPECT_THROW(ReselectionTrigger{rule}, Error);
  rule.page_size = -2;
  EXPECT_THROW(ReselectionTrigger{rule}, Error);
  rule.page_size = 2;
  rule.entropy_threshold = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(ReselectionTrigger{rule}, Error);
  rule.entropy_threshold = 0;
  rule.varentropy_threshold = std::numeric_limits<double>::infinity();
  EXPECT_THROW(ReselectionTrigger{rule}, Error);
  rule.varentropy_threshold = 0;
  ReselectionTrigger t(rule);
  EXPECT_THROW(t.push(std::numeric_limits<double>::quiet_NaN(), 1), Error);
  EXPECT_THROW(t.push(1, std::numeric_limits<double>::infinity()), Error);
  EXPECT_THROW(t.push(-std::numeric_limits<double>::infinity(), 1), Error);
  // Rejected tokens are not counted: the page still needs two good tokens.
  EXPECT_FALSE(t.push(1, 1));
  EXPECT_THROW(t.push(std::numeric_limits<double>::quiet_NaN(), 1), Error);
  EXPECT_EQ(t.pages(), 0);
  EXPECT_TRUE(t.push(1, 1));
  EXPECT_EQ(t.pages(), 1);
  EXPECT_EQ(t.triggered(), 1);
}

}  // namespace
}  // namespace kvcal::runtime
