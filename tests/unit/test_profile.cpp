#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <limits>
#include <numeric>

#include "kvcal/core/error.h"
#include "kvcal/core/random.h"
#include "kvcal/io/attention_dump.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/profile/heads.h"
#include "synthetic_dump.h"
#include "temp_dir.h"

namespace kvcal {
namespace {
namespace fs = std::filesystem;

TEST(AveragePool, KernelsAndBorders) {
  const std::vector<float> row = {0, 0, 3, 0, 0};
  std::vector<float> out(5);
  average_pool(row.data(), 5, 1, out.data());
  EXPECT_EQ(out, row);
  average_pool(row.data(), 5, 3, out.data());
  EXPECT_EQ(out, (std::vector<float>{0, 1, 1, 1, 0}));
  const std::vector<float> edge = {3, 0, 0, 0};
  average_pool(edge.data(), 4, 3, out.data());
  EXPECT_FLOAT_EQ(out[0], 1.5f);  // only positions 0 and 1 are inside the row
  EXPECT_FLOAT_EQ(out[1], 1.0f);
  EXPECT_FLOAT_EQ(out[2], 0.0f);
  average_pool(edge.data(), 4, 4, out.data());  // even kernel: 2 left, 1 right
  EXPECT_FLOAT_EQ(out[0], 1.5f);
  EXPECT_FLOAT_EQ(out[2], 0.75f);
}

TEST(TopK, TiesAndClipping) {
  const std::vector<float> flat(10, 1.0f);
  EXPECT_EQ(top_k(flat.data(), 10, 3), (std::vector<std::int32_t>{0, 1, 2}));  // ties: lower index
  const std::vector<float> v = {0.1f, 0.5f, 0.2f, 0.5f, 0.9f};
  EXPECT_EQ(top_k(v.data(), 5, 2), (std::vector<std::int32_t>{1, 4}));
  EXPECT_EQ(top_k(v.data(), 5, 99).size(), 5u);
  // -0.0 ranks as 0 (not as a huge key), tiny values above zero win.
  const std::vector<float> zeros = {-0.0f, 0.0f, 1e-30f, 0.0f};
  EXPECT_EQ(top_k(zeros.data(), 4, 2), (std::vector<std::int32_t>{0, 2}));
  // Against a brute-force sort on random rows with many ties.
  Rng rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const std::int64_t len = 1 + static_cast<std::int64_t>(rng.below(3000));
    std::vector<float> row(static_cast<std::size_t>(len));
    for (auto& x : row) x = static_cast<float>(rng.below(40)) * (rng.uniform() < 0.5 ? 1e-3f : 1.0f);
    const std::int64_t k = 1 + static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(len)));
    std::vector<std::int32_t> order(static_cast<std::size_t>(len));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return row[a] > row[b]; });
    std::vector<std::int32_t> want(order.begin(), order.begin() + k);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(top_k(row.data(), len, k), want) << "trial " << trial << " len " << len << " k " << k;
  }
  OverlapOptions o;
  o.topk = 1024;
  EXPECT_EQ(topk_for_row(100, o), 100);
  o.topk_frac = 0.1;
  EXPECT_EQ(topk_for_row(95, o), 10);  // ceil(9.5)
  EXPECT_EQ(topk_for_row(3, o), 1);
}

TEST(Overlap, EdgeCases) {
  using V = std::vector<std::int32_t>;
  EXPECT_EQ(overlap_coefficient(V{}, V{1, 2}), 0.0);
  EXPECT_EQ(overlap_coefficient(V{1, 2, 3}, V{1, 2, 3}), 1.0);
  EXPECT_EQ(overlap_coefficient(V{1, 2}, V{0, 1, 2, 3}), 1.0);  // subset: min denominator
  EXPECT_EQ(overlap_coefficient(V{1, 2}, V{3, 4}), 0.0);
  EXPECT_DOUBLE_EQ(overlap_coefficient(V{1, 2, 3, 4}, V{3, 4, 5, 6, 7}), 0.5);
}

TEST(Median, OddEvenSingle) {
  EXPECT_EQ(median({3}), 3);
  EXPECT_EQ(median({3, 1, 2}), 2);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(median({1, 1, 5, 5}), 3);
  EXPECT_THROW(median({}), Error);
}

TEST(ReduceGqa, MeanAndMax) {
  // 1 outer block, 4 query heads -> 2 KV heads, rows of length 2.
  const std::vector<float> rows = {1, 0, 0, 1, 0.5f, 0.5f, 1, 0};
  EXPECT_EQ(reduce_gqa(rows, 1, 4, 2, 2, GqaReduce::mean), (std::vector<float>{0.5f, 0.5f, 0.75f, 0.25f}));
  EXPECT_EQ(reduce_gqa(rows, 1, 4, 2, 2, GqaReduce::max), (std::vector<float>{1, 1, 1, 0.5f}));
  EXPECT_EQ(reduce_gqa(rows, 1, 4, 4, 2, GqaReduce::mean), rows);
  EXPECT_THROW(reduce_gqa(rows, 1, 4, 3, 2, GqaReduce::mean), Error);
}

// pairwise matrix with the given undirected edges (overlap 1), others 0.
std::vector<float> graph(std::int64_t h, const std::vector<std::pair<int, int>>& edges) {
  std::vector<float> p(static_cast<std::size_t>(h * h), 0.0f);
  for (std::int64_t i = 0; i < h; ++i) p[i * h + i] = 1;
  for (auto [a, b] : edges) p[a * h + b] = p[b * h + a] = 1;
  return p;
}

TEST(StarClustering, HandBuiltGraphs) {
  TaxonomyOptions opt;
  const std::vector<float> stable(6, 0.9f), sim(6, 1.0f);
  // A star centred on 2.
  auto t = classify_layer(stable, sim, graph(6, {{2, 0}, {2, 1}, {2, 3}}), 6, opt);
  EXPECT_EQ(t.role[2], HeadRole::pivot);
  for (int s : {0, 1, 3}) {
    EXPECT_EQ(t.role[s], HeadRole::satellite);
    EXPECT_EQ(t.pivot[s], 2);
  }
  EXPECT_EQ(t.role[4], HeadRole::anchor);
  EXPECT_EQ(t.pivot[4], -1);
  // Ties: two disjoint edges; the lowest index of equal degree wins.
  t = classify_layer(stable, sim, graph(6, {{4, 5}, {1, 0}}), 6, opt);
  EXPECT_EQ(t.role[0], HeadRole::pivot);
  EXPECT_EQ(t.role[1], HeadRole::satellite);
  EXPECT_EQ(t.role[4], HeadRole::pivot);
  EXPECT_EQ(t.role[5], HeadRole::satellite);
  // A path 0-1-2-3-4: 1 (degree 2, lowest) first, then 3 takes 2 and 4.
  t = classify_layer(stable, sim, graph(6, {{0, 1}, {1, 2}, {2, 3}, {3, 4}}), 6, opt);
  EXPECT_EQ(t.role[1], HeadRole::pivot);
  EXPECT_EQ(t.pivot[0], 1);
  EXPECT_EQ(t.pivot[2], 1);
  EXPECT_EQ(t.role[3], HeadRole::pivot);
  EXPECT_EQ(t.pivot[4], 3);
  // Leftovers split by stability.
  std::vector<float> mixed = {0.9f, 0.1f, 0.5f, 0.49f, 0.9f, 0.9f};
  t = classify_layer(mixed, sim, graph(6, {{4, 5}}), 6, opt);
  EXPECT_EQ(t.role[0], HeadRole::anchor);
  EXPECT_EQ(t.role[1], HeadRole::volatile_head);
  EXPECT_EQ(t.role[2], HeadRole::anchor);  // >= tau_stable
  EXPECT_EQ(t.role[3], HeadRole::volatile_head);
  // Similar-first: a head below tau_sim takes no part in clustering.
  std::vector<float> low_sim = {0.2f, 1, 1, 1, 1, 1};
  opt.order = TaxonomyOrder::similar_first;
  t = classify_layer(stable, low_sim, graph(6, {{0, 1}, {0, 2}, {1, 2}}), 6, opt);
  EXPECT_EQ(t.role[0], HeadRole::anchor);
  EXPECT_EQ(t.role[1], HeadRole::pivot);
  EXPECT_EQ(t.role[2], HeadRole::satellite);
}

TEST(Budgets, InverseStabilityAndEdgeCases) {
  using R = HeadRole;
  BudgetOptions opt;
  opt.budget = 0.5;
  // 4 heads: one pivot (full), three compressed with S = 1, 0.5, 0.25.
  std::vector<R> roles = {R::pivot, R::satellite, R::anchor, R::anchor};
  auto r = allocate_budgets(roles, {1, 1, 0.5f, 0.25f}, opt);
  EXPECT_EQ(r[0], 1.0f);
  // pool = 0.5 * 4 - 1 = 1, weights 1 : 2 : 4.
  EXPECT_NEAR(r[1], 1.0 / 7, 1e-6);
  EXPECT_NEAR(r[2], 2.0 / 7, 1e-6);
  EXPECT_NEAR(r[3], 4.0 / 7, 1e-6);
  EXPECT_NEAR(std::accumulate(r.begin(), r.end(), 0.0) / 4, 0.5, 1e-6);
  // rho N < N_full: a clear error naming the smallest budget.
  try {
    allocate_budgets({R::pivot, R::volatile_head, R::pivot, R::anchor}, {1, 0, 1, 1}, {0.5, 1e-3});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0.7500"), std::string::npos) << e.what();
  }
  // S_stable = 0: floored weight, no division by zero; cap at 1 with the excess redistributed.
  opt.budget = 0.9;
  r = allocate_budgets({R::anchor, R::anchor, R::anchor, R::anchor}, {0, 1, 1, 1}, opt);
  EXPECT_EQ(r[0], 1.0f);  // capped
  EXPECT_NEAR(r[1], (3.6 - 1) / 3, 1e-6);
  EXPECT_NEAR(std::accumulate(r.begin(), r.end(), 0.0) / 4, 0.9, 1e-6);
  for (float x : r) EXPECT_LE(x, 1.0f);
  // Only full heads: every ratio is 1.
  r = allocate_budgets({R::pivot, R::volatile_head}, {1, 0}, {1.0, 1e-3});
  EXPECT_EQ(r, (std::vector<float>{1, 1}));
  EXPECT_THROW(allocate_budgets(roles, {1, 1, 1, 1}, {0.0, 1e-3}), Error);
  EXPECT_THROW(allocate_budgets(roles, {1, 1, 1, 1}, {1.5, 1e-3}), Error);
}

using test::planted_sample;

using ProfileFiles = test::TempDirTest;

HeadProfileOptions planted_options() {
  HeadProfileOptions o;
  o.overlap.pool_kernel = 1;
  o.overlap.topk = 8;
  o.budget.budget = 0.5;
  return o;
}

void expect_planted_roles(const HeadProfile& p) {
  using R = HeadRole;
  const std::vector<R> want = {R::pivot, R::satellite, R::satellite,     R::anchor,
                               R::pivot, R::satellite, R::volatile_head, R::anchor};
  const std::vector<std::int32_t> pivots = {0, 0, 0, -1, 0, 0, -1, -1};
  ASSERT_EQ(p.role.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(static_cast<R>(p.role[i]), want[i]) << "head " << i;
    EXPECT_EQ(p.pivot[i], pivots[i]) << "head " << i;
  }
  const std::vector<float> stability = {1, 1, 1, 1, 0, 0, 0, 1};
  const std::vector<float> similarity = {1, 1, 1, 0, 1, 1, 0, 0};
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(p.stability[i], stability[i], 1e-6) << "head " << i;
    EXPECT_NEAR(p.similarity[i], similarity[i], 1e-6) << "head " << i;
  }
  EXPECT_NEAR(p.pairwise[0 * 4 + 1], 1.0, 1e-6);
  EXPECT_NEAR(p.pairwise[0 * 4 + 3], 0.0, 1e-6);
  double mean = 0;
  for (float r : p.budget_ratio) mean += r;
  EXPECT_NEAR(mean / 8, 0.5, 1e-6);
  for (int full : {0, 4, 6}) EXPECT_EQ(p.budget_ratio[full], 1.0f);
  EXPECT_NEAR(p.budget_ratio[5], 1000.0 / 1004.0, 1e-5);  // S_stable = 0: floored weight 1000
  EXPECT_NEAR(p.budget_ratio[1], 1.0 / 1004.0, 1e-6);
}

TEST_F(ProfileFiles, PlantedRolesFloat32AndFloat16) {
  for (bool half : {false, true}) {
    SCOPED_TRACE(half ? "float16" : "float32");
    const std::string f = path(half ? "planted16.h5" : "planted32.h5");
    test::write_dump(f, 2, 8, 4, {planted_sample("a"), planted_sample("b")}, half);
    const HeadProfile p = profile_heads({f}, planted_options());
    EXPECT_EQ(p.num_samples, 2);
    expect_planted_roles(p);
    write_head_profile(path("heads.h5"), p, "test");
    const HeadProfile back = read_head_profile(path("heads.h5"));
    EXPECT_EQ(back.role, p.role);
    EXPECT_EQ(back.pivot, p.pivot);
    EXPECT_EQ(back.budget_ratio, p.budget_ratio);
    EXPECT_EQ(back.pairwise, p.pairwise);
    EXPECT_EQ(back.dump_sha256, p.dump_sha256);
    EXPECT_EQ(back.dump_sha256.front().size(), 64u);
    EXPECT_EQ(back.options.tau_drift, 0.5);
  }
}

// The three steps the MPI layer runs on several ranks: items profiled in any
// split of ranges (here: every split point, and item by item) and reduced in
// plan order give exactly profile_heads' bytes.
TEST_F(ProfileFiles, PlanItemsReduceEqualsProfileHeadsForAnySplit) {
  const std::string f1 = path("split1.h5"), f2 = path("split2.h5");
  test::write_dump(f1, 2, 8, 4, {planted_sample("a"), planted_sample("b")}, true);
  test::write_dump(f2, 2, 8, 4, {planted_sample("c")}, false);
  const HeadProfile want = profile_heads({f1, f2}, planted_options());
  const ProfilePlan plan = plan_head_profile({f1, f2}, planted_options());
  ASSERT_EQ(plan.items.size(), 6u);  // 3 samples x 2 layers, sample-major
  EXPECT_EQ(plan.items[2].dump, 0u);
  EXPECT_EQ(plan.items[2].sample, 1u);
  EXPECT_EQ(plan.items[5].dump, 1u);
  EXPECT_EQ(plan.items[5].layer, 1);
  const std::vector<std::string> sha = want.dump_sha256;
  for (std::size_t cut = 0; cut <= plan.items.size(); ++cut) {
    SCOPED_TRACE(cut);
    std::vector<LayerOverlaps> all = profile_items(plan, 0, cut);
    for (std::size_t i = cut; i < plan.items.size(); ++i) all.push_back(profile_items(plan, i, i + 1).front());
    const HeadProfile got = reduce_head_profile(plan, all, sha);
    EXPECT_EQ(got.stability, want.stability);
    EXPECT_EQ(got.similarity, want.similarity);
    EXPECT_EQ(got.pairwise, want.pairwise);
    EXPECT_EQ(got.role, want.role);
    EXPECT_EQ(got.pivot, want.pivot);
    EXPECT_EQ(got.budget_ratio, want.budget_ratio);
    EXPECT_EQ(got.num_samples, 3);
  }
  // A stop requested between items ends the range early.
  int calls = 0;
  EXPECT_THROW(profile_items(plan, 0, 6, nullptr,
                             [&] {
                               if (++calls == 3) throw std::runtime_error("stop");
                             }),
               std::runtime_error);
  EXPECT_EQ(calls, 3);
  EXPECT_THROW(reduce_head_profile(plan, {}, sha), Error);
  EXPECT_THROW(profile_items(plan, 4, 7), Error);
}

TEST_F(ProfileFiles, AlreadyAggregatedHeadsAndGqaMax) {
  test::write_dump(path("kv.h5"), 2, 8, 4, {planted_sample("a", 4)});
  expect_planted_roles(profile_heads({path("kv.h5")}, planted_options()));
  HeadProfileOptions o = planted_options();
  o.gqa = GqaReduce::max;
  test::write_dump(path("q.h5"), 2, 8, 4, {planted_sample("a", 8)});
  const HeadProfile p = profile_heads({path("q.h5")}, o);
  EXPECT_EQ(p.role, profile_heads({path("kv.h5")}, planted_options()).role);
}

TEST_F(ProfileFiles, PoolingKeepsThePlantedRoles) {
  test::write_dump(path("p.h5"), 2, 8, 4, {planted_sample("a")});
  HeadProfileOptions o = planted_options();
  o.overlap.pool_kernel = 5;
  const HeadProfile p = profile_heads({path("p.h5")}, o);
  // Pooling blurs the 8-wide peaks but keeps them far apart.
  EXPECT_EQ(p.role, profile_heads({path("p.h5")}, planted_options()).role);
}

// Each tampering must give an Error naming the sample and the dataset.
TEST_F(ProfileFiles, BadDumpsAreRejectedWithTheirLocation) {
  struct Bad {
    const char* what;
    std::function<void(test::SyntheticSample&)> edit;
    const char* expect;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Bad> cases = {
      {"NaN", [nan](test::SyntheticSample& s) { s.decode[5] = nan; }, "non-finite"},
      {"negative", [](test::SyntheticSample& s) { s.prefill[3] = -0.5f; }, "negative"},
      {"unnormalized", [](test::SyntheticSample& s) { s.prefill[0] += 0.5f; }, "sums to"},
      {"padding", [](test::SyntheticSample& s) { s.decode[162] = 0.01f; }, "padding"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    auto s = planted_sample("bad_sample");
    c.edit(s);
    test::write_dump(path("bad.h5"), 2, 8, 4, {s});
    try {
      profile_heads({path("bad.h5")}, planted_options());
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("bad_sample"), std::string::npos) << m;
      EXPECT_NE(m.find(c.expect), std::string::npos) << m;
      EXPECT_NE(m.find("dataset '"), std::string::npos) << m;
    }
  }
}

TEST_F(ProfileFiles, WrongShapesAndAttributes) {
  auto expect_error = [&](const std::string& f, const std::string& word) {
    try {
      AttentionDump d(f);
      ADD_FAILURE() << "accepted " << f;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  // Root says 3 layers, data has 2.
  test::write_dump(path("l.h5"), 2, 8, 4, {planted_sample("s")}, false,
                   [](hid_t f) { detail::write_attr(f, "num_layers", std::int64_t{3}); });
  expect_error(path("l.h5"), "num_layers");
  // 8 stored heads, but the root says Hq = 6, Hkv = 3.
  test::write_dump(path("h.h5"), 2, 6, 3, {planted_sample("s")});
  expect_error(path("h.h5"), "heads");
  // A missing dataset.
  test::write_dump(path("m.h5"), 2, 8, 4, {planted_sample("s")}, false,
                   [](hid_t f) { H5Ldelete(f, "/samples/s/decode", H5P_DEFAULT); });
  expect_error(path("m.h5"), "decode");
  // A missing root attribute.
  test::write_dump(path("a.h5"), 2, 8, 4, {planted_sample("s")}, false, [](hid_t f) { H5Adelete(f, "num_kv_heads"); });
  expect_error(path("a.h5"), "num_kv_heads");
  // Truncated.
  test::write_dump(path("t.h5"), 2, 8, 4, {planted_sample("s")});
  fs::resize_file(path("t.h5"), fs::file_size(path("t.h5")) / 2);
  EXPECT_THROW(profile_heads({path("t.h5")}, planted_options()), Error);
  // Two dumps of different models.
  test::write_dump(path("ok.h5"), 2, 8, 4, {planted_sample("s")});
  test::write_dump(path("other.h5"), 2, 4, 4, {planted_sample("s", 4)});
  EXPECT_THROW(profile_heads({path("ok.h5"), path("other.h5")}, planted_options()), Error);
}

}  // namespace
}  // namespace kvcal
