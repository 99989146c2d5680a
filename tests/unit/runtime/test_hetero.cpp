// Tests of HeteroCache at run time (kvcal/runtime/hetero.h): top_indices
// against a brute-force ranking, make_hetero_plan on constructed head tables
// (budgets, L_base, Eq. 7-8, satellites per pivot, errors) and DriftMonitor on
// hand-built index sets and a brute-force simulation of HeteroCache Algorithm 1
// (lines 19-41) and Eq. 9-10. Every expectation is computed here independently.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "kvcal/runtime/bundle.h"
#include "kvcal/runtime/hetero.h"

namespace kvcal::runtime {
namespace {

// ------------------------------------------------------------ references

// Top-k by brute force: repeatedly take the largest remaining value (lowest
// index on ties), then sort the chosen indices.
std::vector<std::int32_t> ref_top(const std::vector<float>& v, std::int64_t k) {
  std::vector<bool> taken(v.size(), false);
  std::vector<std::int32_t> out;
  for (std::int64_t r = 0; r < k && r < static_cast<std::int64_t>(v.size()); ++r) {
    std::int64_t best = -1;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (taken[i]) continue;
      if (best < 0 || v[i] > v[static_cast<std::size_t>(best)]) best = static_cast<std::int64_t>(i);
    }
    taken[static_cast<std::size_t>(best)] = true;
    out.push_back(static_cast<std::int32_t>(best));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// An attention row of n entries whose top-|set| are exactly `set` (distinct
// values: members get 10 + i/n, the others i/n).
std::vector<float> row_with_top(std::int64_t n, const std::set<std::int32_t>& set) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] =
        (set.count(static_cast<std::int32_t>(i)) ? 10.0f : 0.0f) + static_cast<float>(i) / static_cast<float>(n);
  return v;
}

double ref_median(std::vector<double> w) {
  std::sort(w.begin(), w.end());
  const std::size_t m = w.size();
  return m % 2 ? w[m / 2] : (w[m / 2 - 1] + w[m / 2]) / 2.0;
}

std::int64_t ref_round(double x) { return static_cast<std::int64_t>(std::floor(x + 0.5)); }  // x >= 0

bool is_full_role(Role r) { return r == Role::pivot || r == Role::volatile_head; }

HeadTable make_table(std::int64_t layers, std::int64_t kv_heads) {
  HeadTable t;
  t.layers = layers;
  t.kv_heads = kv_heads;
  t.q_heads = kv_heads;
  const auto n = static_cast<std::size_t>(layers * kv_heads);
  t.role.assign(n, Role::anchor);
  t.pivot.assign(n, -1);
  t.stability.assign(n, 0.5f);
  t.similarity.assign(n, 0.0f);
  t.budget_ratio.assign(n, 0.5f);
  t.tau_drift = 0.5;
  return t;
}

// A random but consistent table: per layer some pivots, satellites pointing
// at a pivot of their layer, the rest anchors or volatile heads.
HeadTable random_table(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> L(1, 4), H(1, 8), kind(0, 3);
  std::uniform_real_distribution<float> ratio(0.001f, 1.0f);
  HeadTable t = make_table(L(rng), H(rng));
  for (std::int64_t l = 0; l < t.layers; ++l) {
    std::vector<std::int32_t> pivots;
    for (std::int64_t h = 0; h < t.kv_heads; ++h) {
      const auto i = static_cast<std::size_t>(l * t.kv_heads + h);
      const int k = kind(rng);
      t.budget_ratio[i] = ratio(rng);
      if (k == 0) {
        t.role[i] = Role::pivot;
        t.pivot[i] = static_cast<std::int32_t>(h);
        pivots.push_back(static_cast<std::int32_t>(h));
      } else if (k == 1) {
        t.role[i] = Role::volatile_head;
      } else {
        t.role[i] = Role::anchor;
      }
    }
    // Make some of the anchors satellites of a pivot of this layer.
    for (std::int64_t h = 0; h < t.kv_heads && !pivots.empty(); ++h) {
      const auto i = static_cast<std::size_t>(l * t.kv_heads + h);
      if (t.role[i] == Role::anchor && kind(rng) >= 2) {
        t.role[i] = Role::satellite;
        t.pivot[i] = pivots[std::uniform_int_distribution<std::size_t>(0, pivots.size() - 1)(rng)];
      }
    }
  }
  return t;
}

// ------------------------------------------------------------ top_indices

TEST(RuntimeHetero, TopIndicesMatchesBruteForce) {
  std::mt19937_64 rng(101);
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t n = std::uniform_int_distribution<int>(0, 40)(rng);
    const std::int64_t k = std::uniform_int_distribution<int>(0, 50)(rng);
    std::vector<float> v(static_cast<std::size_t>(n));
    const bool ties = trial % 2 == 0;
    for (auto& x : v)
      x = ties ? static_cast<float>(std::uniform_int_distribution<int>(-2, 2)(rng))
               : std::normal_distribution<float>(0.0f, 1.0f)(rng);
    const std::vector<std::int32_t> got = top_indices(v.data(), n, k);
    EXPECT_EQ(got, ref_top(v, k)) << "n=" << n << " k=" << k;
    EXPECT_EQ(static_cast<std::int64_t>(got.size()), std::min(n, k));
    EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
    EXPECT_TRUE(std::adjacent_find(got.begin(), got.end()) == got.end());
    // Every kept value is >= every dropped value.
    std::vector<bool> kept(static_cast<std::size_t>(n), false);
    for (const auto i : got) kept[static_cast<std::size_t>(i)] = true;
    for (std::int64_t a = 0; a < n; ++a)
      for (std::int64_t b = 0; b < n; ++b)
        if (kept[static_cast<std::size_t>(a)] && !kept[static_cast<std::size_t>(b)]) {
          EXPECT_GE(v[static_cast<std::size_t>(a)], v[static_cast<std::size_t>(b)]);
          if (v[static_cast<std::size_t>(a)] == v[static_cast<std::size_t>(b)]) {
            EXPECT_LT(a, b);  // ties: lower index
          }
        }
  }
}

TEST(RuntimeHetero, TopIndicesHandCases) {
  const std::vector<float> v{3, 1, 3, 2, 3, 0};
  EXPECT_EQ(top_indices(v.data(), 6, 0), std::vector<std::int32_t>{});
  EXPECT_EQ(top_indices(v.data(), 6, 1), (std::vector<std::int32_t>{0}));
  EXPECT_EQ(top_indices(v.data(), 6, 2), (std::vector<std::int32_t>{0, 2}));  // ties 0, 2, 4: lower first
  EXPECT_EQ(top_indices(v.data(), 6, 3), (std::vector<std::int32_t>{0, 2, 4}));
  EXPECT_EQ(top_indices(v.data(), 6, 4), (std::vector<std::int32_t>{0, 2, 3, 4}));
  EXPECT_EQ(top_indices(v.data(), 6, 6), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(top_indices(v.data(), 6, 100), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5}));  // k > n
  EXPECT_EQ(top_indices(v.data(), 0, 3), std::vector<std::int32_t>{});
  const std::vector<float> neg{-5, -1, -3};
  EXPECT_EQ(top_indices(neg.data(), 3, 2), (std::vector<std::int32_t>{1, 2}));
  EXPECT_THROW(top_indices(v.data(), -1, 2), Error);
  EXPECT_THROW(top_indices(v.data(), 6, -1), Error);
}

// ------------------------------------------------------------ make_hetero_plan

TEST(RuntimeHetero, PlanHandExample) {
  // One layer, 5 heads: pivot 0, satellites 1 and 3 of pivot 0, anchor 2, volatile 4.
  HeadTable t = make_table(1, 5);
  t.role = {Role::pivot, Role::satellite, Role::anchor, Role::satellite, Role::volatile_head};
  t.pivot = {0, 0, -1, 0, -1};
  t.budget_ratio = {1.0f, 0.25f, 0.1f, 0.5f, 1.0f};
  t.tau_drift = 0.625;
  const HeteroPlan p = make_hetero_plan(t, 100, 6);
  EXPECT_EQ(p.layers, 1);
  EXPECT_EQ(p.kv_heads, 5);
  EXPECT_EQ(p.context, 100);
  EXPECT_EQ(p.window, 6);
  EXPECT_DOUBLE_EQ(p.tau_drift, 0.625);
  EXPECT_EQ(p.full, (std::vector<std::uint8_t>{1, 0, 0, 0, 1}));
  EXPECT_EQ(p.budget, (std::vector<std::int64_t>{100, 25, 10, 50, 100}));
  EXPECT_EQ(p.pivot, (std::vector<std::int32_t>{-1, 0, -1, 0, -1}));
  ASSERT_EQ(p.satellites.size(), 5u);
  EXPECT_EQ(p.satellites[0], (std::vector<std::int32_t>{1, 3}));
  for (std::size_t i = 1; i < 5; ++i) EXPECT_TRUE(p.satellites[i].empty()) << i;
  EXPECT_EQ(p.compressed_heads, 3);
  EXPECT_EQ(p.budget_sum, 85);
  EXPECT_EQ(p.l_base, 28);  // round(85 / 3 = 28.33)
  EXPECT_TRUE(p.is_full(0, 0));
  EXPECT_FALSE(p.is_full(0, 2));
  EXPECT_TRUE(p.is_full(0, 4));
}

TEST(RuntimeHetero, PlanRoundingAndClamping) {
  HeadTable t = make_table(1, 4);
  t.role = {Role::anchor, Role::anchor, Role::anchor, Role::anchor};
  // 0.5 * 3 = 1.5 -> 2 (half away from zero); tiny ratio -> clamped to 1; 1.0 -> context; 0.3 * 3 = 0.9 -> 1.
  t.budget_ratio = {0.5f, 1e-6f, 1.0f, 0.3f};
  const HeteroPlan p = make_hetero_plan(t, 3);
  EXPECT_EQ(p.budget, (std::vector<std::int64_t>{2, 1, 3, 1}));
  EXPECT_EQ(p.budget_sum, 7);
  EXPECT_EQ(p.compressed_heads, 4);
  EXPECT_EQ(p.l_base, 2);  // round(1.75)
  EXPECT_EQ(p.window, 8);  // default
  // context 1: every budget is 1.
  const HeteroPlan one = make_hetero_plan(t, 1);
  EXPECT_EQ(one.budget, (std::vector<std::int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(one.l_base, 1);
}

TEST(RuntimeHetero, PlanWithoutCompressedHeads) {
  HeadTable t = make_table(2, 2);
  t.role = {Role::pivot, Role::volatile_head, Role::volatile_head, Role::pivot};
  t.pivot = {0, -1, -1, 1};
  t.budget_ratio = {1, 1, 1, 1};
  const HeteroPlan p = make_hetero_plan(t, 77);
  EXPECT_EQ(p.compressed_heads, 0);
  EXPECT_EQ(p.budget_sum, 0);
  EXPECT_EQ(p.budget, (std::vector<std::int64_t>{77, 77, 77, 77}));
  EXPECT_EQ(p.l_base, 77);  // no compressed head: L_base is the context
}

TEST(RuntimeHetero, PlanMatchesBruteForceOnRandomTables) {
  std::mt19937_64 rng(202);
  for (int trial = 0; trial < 300; ++trial) {
    const HeadTable t = random_table(rng);
    const std::int64_t context = std::uniform_int_distribution<int>(1, 5000)(rng);
    const HeteroPlan p = make_hetero_plan(t, context, 4);
    const std::int64_t n = t.layers * t.kv_heads;
    ASSERT_EQ(static_cast<std::int64_t>(p.budget.size()), n);
    std::int64_t comp = 0, sum = 0;
    std::vector<std::vector<std::int32_t>> sats(static_cast<std::size_t>(n));
    for (std::int64_t l = 0; l < t.layers; ++l)
      for (std::int64_t h = 0; h < t.kv_heads; ++h) {
        const auto i = static_cast<std::size_t>(l * t.kv_heads + h);
        const bool full = is_full_role(t.role[i]);
        EXPECT_EQ(p.full[i] != 0, full) << i;
        EXPECT_EQ(p.is_full(l, h), full);
        if (full) {
          EXPECT_EQ(p.budget[i], context);
        } else {
          const std::int64_t b =
              std::clamp<std::int64_t>(ref_round(static_cast<double>(t.budget_ratio[i]) * context), 1, context);
          EXPECT_EQ(p.budget[i], b) << "ratio " << t.budget_ratio[i] << " context " << context;
          ++comp;
          sum += b;
        }
        if (t.role[i] == Role::satellite) {
          EXPECT_EQ(p.pivot[i], t.pivot[i]);
          sats[static_cast<std::size_t>(l * t.kv_heads + t.pivot[i])].push_back(static_cast<std::int32_t>(h));
        } else {
          EXPECT_EQ(p.pivot[i], -1);
        }
      }
    EXPECT_EQ(p.compressed_heads, comp);
    EXPECT_EQ(p.budget_sum, sum);
    if (comp > 0) {
      EXPECT_EQ(p.l_base, std::max<std::int64_t>(1, ref_round(static_cast<double>(sum) / comp)));
    } else {
      EXPECT_EQ(p.l_base, context);
    }
    EXPECT_EQ(p.satellites, sats);
    for (std::int64_t i = 0; i < n; ++i)
      if (!p.satellites[static_cast<std::size_t>(i)].empty()) {
        EXPECT_EQ(t.role[static_cast<std::size_t>(i)], Role::pivot);
      }
  }
}

// Eq. 7-8: with w_i = 1/S_stable and l_i = N_comp * L_base * w_i / sum(w) (the
// consistent reading of Eq. 8), a profile whose ratios are l_i / L gives
// budgets summing to N_comp * L_base up to rounding, and Eq. 7 holds with
// rho = mean(budget_ratio): sum l_i = (rho N - N_full) L.
TEST(RuntimeHetero, PlanFollowsEquations7And8) {
  std::mt19937_64 rng(303);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t layers = std::uniform_int_distribution<int>(1, 4)(rng);
    const std::int64_t heads = std::uniform_int_distribution<int>(2, 8)(rng);
    HeadTable t = make_table(layers, heads);
    const std::int64_t n = layers * heads;
    std::int64_t n_full = 0;
    std::vector<std::size_t> comp_idx;
    for (std::int64_t l = 0; l < layers; ++l) {
      // head 0 of every layer is a pivot; others random among volatile, anchor, satellite.
      for (std::int64_t h = 0; h < heads; ++h) {
        const auto i = static_cast<std::size_t>(l * heads + h);
        const int k = h == 0 ? 0 : std::uniform_int_distribution<int>(1, 3)(rng);
        t.role[i] = k == 0 ? Role::pivot : k == 1 ? Role::volatile_head : k == 2 ? Role::anchor : Role::satellite;
        t.pivot[i] = k == 0 ? static_cast<std::int32_t>(h) : k == 3 ? 0 : -1;
        t.stability[i] = std::uniform_real_distribution<float>(0.3f, 1.0f)(rng);
        if (is_full_role(t.role[i])) {
          ++n_full;
          t.budget_ratio[i] = 1.0f;
        } else {
          comp_idx.push_back(i);
        }
      }
    }
    const std::int64_t context = std::uniform_int_distribution<int>(2000, 20000)(rng);
    const std::int64_t L_base = std::uniform_int_distribution<int>(10, 500)(rng);
    const auto n_comp = static_cast<std::int64_t>(comp_idx.size());
    double wsum = 0;
    for (const auto i : comp_idx) wsum += 1.0 / t.stability[i];
    std::vector<double> l_real(static_cast<std::size_t>(n), 0.0);
    for (const auto i : comp_idx) {
      l_real[i] = static_cast<double>(n_comp * L_base) * (1.0 / t.stability[i]) / wsum;  // Eq. 8
      t.budget_ratio[i] = static_cast<float>(l_real[i] / static_cast<double>(context));
    }
    double rho = 0;
    for (const float r : t.budget_ratio) rho += r;
    rho /= static_cast<double>(n);
    t.budget = rho;
    const HeteroPlan p = make_hetero_plan(t, context);
    EXPECT_EQ(p.compressed_heads, n_comp);
    for (const auto i : comp_idx) {
      // the float ratio may move l_i by a tiny amount; the rounding error stays ~1/2
      EXPECT_LE(std::abs(static_cast<double>(p.budget[i]) - l_real[i]), 0.5 + 1e-3) << i;
      EXPECT_GE(p.budget[i], 1);
    }
    if (n_comp == 0) continue;
    EXPECT_LE(std::abs(static_cast<double>(p.budget_sum - n_comp * L_base)), n_comp / 2.0 + 1e-3 * n_comp);
    // Eq. 7: (rho N - N_full) L = sum of the compressed budgets (before rounding).
    const double eq7 = (rho * static_cast<double>(n) - static_cast<double>(n_full)) * static_cast<double>(context);
    EXPECT_NEAR(eq7 / static_cast<double>(n_comp), static_cast<double>(L_base), 1e-3 * L_base + 0.05);
    EXPECT_LE(std::abs(p.l_base - L_base), 1);
  }
}

TEST(RuntimeHetero, PlanErrors) {
  const auto good = [] {
    HeadTable t = make_table(1, 3);
    t.role = {Role::pivot, Role::satellite, Role::anchor};
    t.pivot = {0, 0, -1};
    t.budget_ratio = {1.0f, 0.5f, 0.5f};
    return t;
  };
  EXPECT_NO_THROW(make_hetero_plan(good(), 10));
  EXPECT_THROW(make_hetero_plan(good(), 0), Error);      // context < 1
  EXPECT_THROW(make_hetero_plan(good(), -5), Error);     // context < 1
  EXPECT_THROW(make_hetero_plan(good(), 10, 0), Error);  // window < 1
  {
    HeadTable t = good();
    t.role.pop_back();
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    HeadTable t = good();
    t.pivot.push_back(-1);
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    HeadTable t = good();
    t.budget_ratio.pop_back();
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    HeadTable t = good();
    t.layers = 2;  // sizes no longer layers x kv_heads
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    HeadTable t = good();
    t.layers = 0;
    t.role.clear();
    t.pivot.clear();
    t.budget_ratio.clear();
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  for (const int bad : {0, 5, -1, 100}) {
    HeadTable t = good();
    t.role[2] = static_cast<Role>(bad);
    EXPECT_THROW(make_hetero_plan(t, 10), Error) << bad;
  }
  {
    HeadTable t = good();  // satellite's pivot is an anchor
    t.pivot[1] = 2;
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    HeadTable t = good();  // satellite's pivot is itself
    t.pivot[1] = 1;
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  for (const int pv : {-1, 3, 99}) {
    HeadTable t = good();  // satellite's pivot out of range
    t.pivot[1] = pv;
    EXPECT_THROW(make_hetero_plan(t, 10), Error) << pv;
  }
  {
    HeadTable t = good();  // satellite's pivot is a satellite
    t.role = {Role::pivot, Role::satellite, Role::satellite};
    t.pivot = {0, 0, 1};
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  for (const float r :
       {0.0f, -0.25f, 1.5f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    HeadTable t = good();
    t.budget_ratio[2] = r;
    EXPECT_THROW(make_hetero_plan(t, 10), Error) << r;
    HeadTable u = good();
    u.budget_ratio[0] = r;  // also for a full head
    EXPECT_THROW(make_hetero_plan(u, 10), Error) << r;
  }
  {
    HeadTable t = good();
    t.tau_drift = std::numeric_limits<double>::quiet_NaN();
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
  {
    // A satellite pointing at a pivot head in another layer's position is
    // checked within its own layer: head 0 of layer 1 is an anchor.
    HeadTable t = make_table(2, 2);
    t.role = {Role::pivot, Role::anchor, Role::anchor, Role::satellite};
    t.pivot = {0, -1, -1, 0};
    EXPECT_THROW(make_hetero_plan(t, 10), Error);
  }
}

// ------------------------------------------------------------ DriftMonitor

TEST(RuntimeHetero, DriftHandExampleOddWindow) {
  // L_base = 3, W = 3, tau = 0.5; 8 tokens.
  DriftMonitor m(3, 3, 0.5);
  const std::vector<float> prefill{0.1f, 0.9f, 0.8f, 0.7f, 0.0f, 0.2f, 0.05f, 0.01f};
  m.init(prefill.data(), 8);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(m.steps(), 0);

  const auto step = [&](std::set<std::int32_t> s) {
    const auto row = row_with_top(8, s);
    return m.step(row.data(), 8);
  };
  // Window 1: overlaps 2/3, 0, 1 -> median 2/3 >= 0.5: no drift.
  auto s = step({1, 2, 5});
  EXPECT_DOUBLE_EQ(s.overlap, 2.0 / 3.0);
  EXPECT_FALSE(s.checked);
  EXPECT_FALSE(s.drift);
  s = step({0, 4, 5});
  EXPECT_DOUBLE_EQ(s.overlap, 0.0);
  EXPECT_FALSE(s.checked);
  s = step({1, 2, 3});
  EXPECT_DOUBLE_EQ(s.overlap, 1.0);
  EXPECT_TRUE(s.checked);
  EXPECT_DOUBLE_EQ(s.median, 2.0 / 3.0);
  EXPECT_FALSE(s.drift);
  EXPECT_EQ(m.drifts(), 0);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{1, 2, 3}));
  // Window 2: overlaps 0, 1/3, 0 -> median 0 < 0.5: drift, base := {0, 4, 5}.
  s = step({0, 4, 6});
  EXPECT_DOUBLE_EQ(s.overlap, 0.0);
  s = step({3, 6, 7});
  EXPECT_DOUBLE_EQ(s.overlap, 1.0 / 3.0);
  s = step({0, 4, 5});
  EXPECT_DOUBLE_EQ(s.overlap, 0.0);
  EXPECT_TRUE(s.checked);
  EXPECT_DOUBLE_EQ(s.median, 0.0);
  EXPECT_TRUE(s.drift);
  EXPECT_EQ(m.drifts(), 1);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{0, 4, 5}));
  // Later overlaps are measured against the new base.
  s = step({0, 4, 5});
  EXPECT_DOUBLE_EQ(s.overlap, 1.0);
  s = step({1, 2, 3});  // the old base: no overlap now
  EXPECT_DOUBLE_EQ(s.overlap, 0.0);
  s = step({0, 1, 2});
  EXPECT_DOUBLE_EQ(s.overlap, 1.0 / 3.0);
  EXPECT_TRUE(s.checked);
  EXPECT_DOUBLE_EQ(s.median, 1.0 / 3.0);
  EXPECT_TRUE(s.drift);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(m.steps(), 9);
  EXPECT_EQ(m.drifts(), 2);
  // init resets the counters and the base.
  m.init(prefill.data(), 8);
  EXPECT_EQ(m.steps(), 0);
  EXPECT_EQ(m.drifts(), 0);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{1, 2, 3}));
}

TEST(RuntimeHetero, DriftEvenWindowMedianAndThresholdEquality) {
  // L_base = 4, W = 4: the median is the mean of the two middle overlaps.
  const std::vector<float> prefill = row_with_top(10, {0, 1, 2, 3});
  const auto run = [&](double tau) {
    DriftMonitor m(4, 4, tau);
    m.init(prefill.data(), 10);
    // overlaps 4/4, 3/4, 2/4, 1/4 -> sorted 0.25 0.5 0.75 1 -> median 0.625
    const std::vector<std::set<std::int32_t>> sets{{0, 1, 2, 3}, {0, 1, 2, 9}, {2, 3, 8, 9}, {0, 5, 6, 7}};
    DriftMonitor::Step s;
    for (std::size_t i = 0; i < sets.size(); ++i) {
      const auto row = row_with_top(10, sets[i]);
      s = m.step(row.data(), 10);
      const double want[] = {1.0, 0.75, 0.5, 0.25};
      EXPECT_DOUBLE_EQ(s.overlap, want[i]);
      EXPECT_EQ(s.checked, i == 3);
    }
    EXPECT_DOUBLE_EQ(s.median, 0.625);
    return std::make_pair(s.drift, m.base());
  };
  auto [d1, b1] = run(0.625);  // equal: no drift
  EXPECT_FALSE(d1);
  EXPECT_EQ(b1, (std::vector<std::int32_t>{0, 1, 2, 3}));
  auto [d2, b2] = run(0.62500001);  // just above: drift, base := last step's set
  EXPECT_TRUE(d2);
  EXPECT_EQ(b2, (std::vector<std::int32_t>{0, 5, 6, 7}));
  auto [d3, b3] = run(0.6);
  EXPECT_FALSE(d3);
  (void)b3;
}

TEST(RuntimeHetero, DriftWindowOneChecksEveryStep) {
  DriftMonitor m(2, 1, 0.75);
  const auto pre = row_with_top(6, {4, 5});
  m.init(pre.data(), 6);
  auto row = row_with_top(6, {4, 1});
  auto s = m.step(row.data(), 6);
  EXPECT_TRUE(s.checked);
  EXPECT_DOUBLE_EQ(s.median, 0.5);
  EXPECT_TRUE(s.drift);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{1, 4}));
  row = row_with_top(6, {1, 4});
  s = m.step(row.data(), 6);
  EXPECT_TRUE(s.checked);
  EXPECT_DOUBLE_EQ(s.median, 1.0);
  EXPECT_FALSE(s.drift);
  EXPECT_EQ(m.steps(), 2);
  EXPECT_EQ(m.drifts(), 1);
}

TEST(RuntimeHetero, DriftMatchesBruteForceSimulation) {
  std::mt19937_64 rng(404);
  for (int trial = 0; trial < 60; ++trial) {
    const std::int64_t n = std::uniform_int_distribution<int>(4, 30)(rng);
    const std::int64_t l_base = std::uniform_int_distribution<int>(1, static_cast<int>(n))(rng);
    const std::int64_t W = std::uniform_int_distribution<int>(1, 6)(rng);
    const double tau = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    DriftMonitor m(l_base, W, tau);
    const auto random_row = [&] {
      std::vector<float> v(static_cast<std::size_t>(n));
      // few distinct values: ties exercise the lower-index rule
      for (auto& x : v) x = static_cast<float>(std::uniform_int_distribution<int>(0, 5)(rng));
      return v;
    };
    const auto pre = random_row();
    m.init(pre.data(), n);
    std::vector<std::int32_t> base = ref_top(pre, l_base);
    EXPECT_EQ(m.base(), base);
    std::vector<double> window;
    std::int64_t drifts = 0;
    const int T = std::uniform_int_distribution<int>(1, 40)(rng);
    for (int t = 1; t <= T; ++t) {
      const auto row = random_row();
      const auto cur = ref_top(row, l_base);
      std::int64_t inter = 0;
      for (const auto i : cur) inter += std::count(base.begin(), base.end(), i);
      const double o = static_cast<double>(inter) / static_cast<double>(l_base);
      window.push_back(o);
      const auto s = m.step(row.data(), n);
      EXPECT_DOUBLE_EQ(s.overlap, o);
      const bool check = t % W == 0;
      EXPECT_EQ(s.checked, check) << t;
      if (check) {
        const std::vector<double> last(window.end() - W, window.end());
        const double med = ref_median(last);
        EXPECT_DOUBLE_EQ(s.median, med);
        EXPECT_EQ(s.drift, med < tau);
        if (med < tau) {
          base = cur;
          ++drifts;
        }
      } else {
        EXPECT_FALSE(s.drift);
      }
      EXPECT_EQ(m.base(), base);
      EXPECT_EQ(m.steps(), t);
      EXPECT_EQ(m.drifts(), drifts);
    }
  }
}

TEST(RuntimeHetero, DriftErrors) {
  EXPECT_THROW(DriftMonitor(0, 4, 0.5), Error);
  EXPECT_THROW(DriftMonitor(-3, 4, 0.5), Error);
  EXPECT_THROW(DriftMonitor(4, 0, 0.5), Error);
  EXPECT_THROW(DriftMonitor(4, -1, 0.5), Error);
  EXPECT_THROW(DriftMonitor(4, 4, std::numeric_limits<double>::quiet_NaN()), Error);
  EXPECT_THROW(DriftMonitor(4, 4, std::numeric_limits<double>::infinity()), Error);
  DriftMonitor m(2, 2, 0.5);
  const std::vector<float> row{1, 2, 3};
  EXPECT_THROW(m.step(row.data(), 3), Error);  // before init
  EXPECT_THROW(m.init(row.data(), 0), Error);  // empty prefill
  EXPECT_THROW(m.step(row.data(), 3), Error);  // still not initialised
  m.init(row.data(), 3);
  EXPECT_EQ(m.base(), (std::vector<std::int32_t>{1, 2}));
  EXPECT_NO_THROW(m.step(row.data(), 3));
}

}  // namespace
}  // namespace kvcal::runtime

// satellite_fetches: per satellite of a pivot, its budget's worth of the
// pivot's top tokens, against top_indices computed here.
TEST(RuntimeHetero, SatelliteFetchesAreThePivotsTopTokensPerSatelliteBudget) {
  kvcal::runtime::HeadTable t;
  t.layers = 1;
  t.kv_heads = 4;
  t.q_heads = 4;
  using R = kvcal::runtime::Role;
  t.role = {R::pivot, R::satellite, R::satellite, R::anchor};
  t.pivot = {0, 0, 0, -1};
  t.stability = t.similarity = {1, 1, 1, 1};
  t.budget_ratio = {1.0f, 0.25f, 0.5f, 0.25f};
  t.tau_drift = 0.5;
  const kvcal::runtime::HeteroPlan plan = kvcal::runtime::make_hetero_plan(t, 8);
  const std::vector<float> attn = {0.05f, 0.3f, 0.01f, 0.2f, 0.1f, 0.02f, 0.25f, 0.07f};
  const auto fetches = kvcal::runtime::satellite_fetches(plan, 0, 0, attn.data(), 8);
  ASSERT_EQ(fetches.size(), 2u);
  EXPECT_EQ(fetches[0].head, 1);
  EXPECT_EQ(fetches[0].tokens, (std::vector<std::int32_t>{1, 6}));  // l = round(0.25 * 8) = 2
  EXPECT_EQ(fetches[1].head, 2);
  EXPECT_EQ(fetches[1].tokens, (std::vector<std::int32_t>{1, 3, 4, 6}));               // l = 4
  EXPECT_TRUE(kvcal::runtime::satellite_fetches(plan, 0, 3, attn.data(), 8).empty());  // an anchor has none
  EXPECT_THROW(kvcal::runtime::satellite_fetches(plan, 1, 0, attn.data(), 8), kvcal::runtime::Error);
  EXPECT_THROW(kvcal::runtime::satellite_fetches(plan, 0, 0, attn.data(), 0), kvcal::runtime::Error);
}
