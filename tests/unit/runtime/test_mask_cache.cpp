// kvcal::runtime::MaskCache: LRU order and statistics, bundle masks before
// generation, generated masks checked against an independent dense SVD,
// determinism, errors, and concurrent use (also run under ThreadSanitizer:
// every test here has MaskCache in its name).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <latch>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dense_reference.h"
#include "kvcal/graph/generate.h"
#include "kvcal/runtime/bundle.h"
#include "kvcal/runtime/mask_cache.h"

namespace {

using kvcal::runtime::Error;
using kvcal::runtime::Mask;
using kvcal::runtime::mask_key;
using kvcal::runtime::MaskCache;
using kvcal::runtime::MaskCacheOptions;
using kvcal::runtime::MaskCacheStats;
using kvcal::runtime::MaskKey;

const std::string kGolden = std::string(KVCAL_SOURCE_DIR) + "/tests/golden/bundle_v1.kvcal.h5";

// Small shapes, so the tests stay fast under the sanitizers: lifts
// (96x64 and 96x128 at 1/32), a random fallback for a shape no lift holds
// (48x64, near-biregular) and plain random ones.
const MaskKey kA = mask_key(96, 64, 1.0 / 32);
const MaskKey kB = mask_key(96, 128, 1.0 / 32);
const MaskKey kC = mask_key(48, 64, 1.0 / 32);
const MaskKey kD = mask_key(40, 24, 0.25);
const MaskKey kE = mask_key(32, 48, 0.125);

void expect_stats(const MaskCacheStats& s, std::int64_t hits, std::int64_t misses, std::int64_t generated,
                  std::int64_t from_bundle, std::int64_t evictions) {
  EXPECT_EQ(s.hits, hits);
  EXPECT_EQ(s.misses, misses);
  EXPECT_EQ(s.generated, generated);
  EXPECT_EQ(s.from_bundle, from_bundle);
  EXPECT_EQ(s.evictions, evictions);
}

bool same_mask(const Mask& a, const Mask& b) {
  return a.rows == b.rows && a.cols == b.cols && a.row_degree == b.row_degree && a.indptr == b.indptr &&
         a.indices == b.indices && a.ramanujan == b.ramanujan && a.sigma2 == b.sigma2 &&
         a.ramanujan_bound == b.ramanujan_bound && a.source == b.source;
}

// The CSR invariants the runtime relies on, for the key's shape and degree.
void expect_valid_csr(const Mask& m, const MaskKey& key) {
  ASSERT_EQ(m.rows, key.rows);
  ASSERT_EQ(m.cols, key.cols);
  ASSERT_EQ(m.row_degree, key.row_degree);
  ASSERT_EQ(m.indptr.size(), static_cast<std::size_t>(m.rows + 1));
  ASSERT_EQ(m.nnz(), m.rows * m.row_degree);
  std::vector<std::int64_t> col_degree(static_cast<std::size_t>(m.cols), 0);
  for (std::int64_t i = 0; i < m.rows; ++i) {
    ASSERT_EQ(m.indptr[i], i * m.row_degree);
    for (auto k = m.indptr[i]; k < m.indptr[i + 1]; ++k) {
      ASSERT_GE(m.indices[k], 0);
      ASSERT_LT(m.indices[k], m.cols);
      if (k > m.indptr[i]) {
        ASSERT_LT(m.indices[k - 1], m.indices[k]) << "row " << i;
      }
      ++col_degree[m.indices[k]];
    }
  }
  ASSERT_EQ(m.indptr.back(), m.nnz());
  // (near-)biregular: column degrees differ by at most one
  const auto [lo, hi] = std::minmax_element(col_degree.begin(), col_degree.end());
  EXPECT_LE(*hi - *lo, 1);
  EXPECT_EQ(*hi, (m.nnz() + m.cols - 1) / m.cols);
}

kvcal::CsrMask to_csr(const Mask& m) {
  kvcal::CsrMask c;
  c.rows = m.rows;
  c.cols = m.cols;
  c.indptr = m.indptr;
  c.indices = m.indices;
  return c;
}

TEST(MaskCache, KeyFollowsMaskGenRule) {
  for (const std::int64_t cols : {1, 7, 24, 64, 100, 128, 4096}) {
    for (const double s : {1e-9, 1.0 / 128, 1.0 / 32, 0.03, 0.1, 0.125, 1.0 / 3, 0.5, 0.77, 1.0}) {
      const MaskKey k = mask_key(96, cols, s);
      const kvcal::MaskShape shape = kvcal::resolve_shape(96, cols, std::nullopt, s);
      EXPECT_EQ(k.rows, 96);
      EXPECT_EQ(k.cols, cols);
      EXPECT_EQ(k.row_degree, shape.row_degree) << cols << " cols, sparsity " << s;
    }
  }
  EXPECT_EQ(mask_key(96, 128, 1.0 / 32).row_degree, 4);
  EXPECT_EQ(mask_key(96, 64, 0.001).row_degree, 1);  // at least one
  EXPECT_EQ(mask_key(96, 64, 1.0).row_degree, 64);
  const std::int64_t max_side = std::numeric_limits<std::int32_t>::max();
  EXPECT_EQ(mask_key(max_side, max_side, 1.0).row_degree, max_side);
}

TEST(MaskCache, BadKeysAndOptionsThrow) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::int64_t too_big = std::int64_t{1} << 31;
  EXPECT_THROW(mask_key(0, 64, 0.5), Error);
  EXPECT_THROW(mask_key(96, 0, 0.5), Error);
  EXPECT_THROW(mask_key(-1, 64, 0.5), Error);
  EXPECT_THROW(mask_key(too_big, 64, 0.5), Error);
  EXPECT_THROW(mask_key(96, too_big, 0.5), Error);
  for (const double s : {0.0, -0.25, 1.0000001, 2.0, nan, inf, -inf}) EXPECT_THROW(mask_key(96, 64, s), Error) << s;
  try {
    mask_key(96, 64, 1.5);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1.5"), std::string::npos) << e.what();
  }

  MaskCache cache;
  EXPECT_THROW(cache.get(96, 64, 0.0), Error);
  EXPECT_THROW(cache.get(MaskKey{96, 64, 0}), Error);
  EXPECT_THROW(cache.get(MaskKey{96, 64, 65}), Error);
  EXPECT_THROW(cache.get(MaskKey{0, 64, 1}), Error);
  EXPECT_THROW(cache.get(MaskKey{96, too_big, 1}), Error);
  expect_stats(cache.stats(), 0, 0, 0, 0, 0);  // refused keys count nowhere
  EXPECT_EQ(cache.size(), 0u);

  EXPECT_THROW(MaskCache(MaskCacheOptions{.capacity = 0}), Error);
  EXPECT_THROW(MaskCache(MaskCacheOptions{.method = "lps"}), Error);
  EXPECT_THROW(MaskCache(MaskCacheOptions{.tries = 0}), Error);
  EXPECT_THROW(MaskCache(MaskCacheOptions{.threads = -1}), Error);
  EXPECT_EQ(MaskCache(MaskCacheOptions{.capacity = 3}).capacity(), 3u);
}

TEST(MaskCache, LeastRecentlyUsedIsEvicted) {
  MaskCache cache(MaskCacheOptions{.capacity = 2});
  const auto a1 = cache.get(kA);
  expect_stats(cache.stats(), 0, 1, 1, 0, 0);
  const auto b1 = cache.get(kB);
  expect_stats(cache.stats(), 0, 2, 2, 0, 0);
  EXPECT_EQ(cache.get(kA), a1);  // a hit returns the same mask; A is now the most recent
  expect_stats(cache.stats(), 1, 2, 2, 0, 0);
  const auto c1 = cache.get(kC);  // evicts B, the least recently used
  expect_stats(cache.stats(), 1, 3, 3, 0, 1);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.get(kA), a1);  // A stayed
  expect_stats(cache.stats(), 2, 3, 3, 0, 1);
  EXPECT_EQ(cache.get(kC), c1);  // C stayed
  expect_stats(cache.stats(), 3, 3, 3, 0, 1);
  const auto b2 = cache.get(kB);  // B was evicted: built again, A (now the oldest) goes
  expect_stats(cache.stats(), 3, 4, 4, 0, 2);
  EXPECT_NE(b2, b1);
  EXPECT_TRUE(same_mask(*b2, *b1));  // rebuilt identically
  EXPECT_EQ(cache.get(kC), c1);
  expect_stats(cache.stats(), 4, 4, 4, 0, 2);
  const auto a2 = cache.get(kA);  // A was evicted; B goes
  expect_stats(cache.stats(), 4, 5, 5, 0, 3);
  EXPECT_NE(a2, a1);
  EXPECT_TRUE(same_mask(*a2, *a1));
  EXPECT_EQ(cache.get(kC), c1);
  EXPECT_EQ(cache.get(kA), a2);
  expect_stats(cache.stats(), 6, 5, 5, 0, 3);
  EXPECT_EQ(cache.size(), 2u);
  // Through the (rows, cols, sparsity) overload: the same key.
  EXPECT_EQ(cache.get(96, 64, 1.0 / 32), a2);
  EXPECT_EQ(cache.stats().hits, 7);
}

TEST(MaskCache, EvictedMasksStayValid) {
  MaskCache cache(MaskCacheOptions{.capacity = 1});
  const std::shared_ptr<const Mask> a = cache.get(kA);
  const Mask copy = *a;
  for (const MaskKey& k : {kB, kC, kD, kE}) cache.get(k);  // A is long gone from the cache
  expect_stats(cache.stats(), 0, 5, 5, 0, 4);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_TRUE(same_mask(*a, copy));  // still ours (ASan would see a use after free)
  expect_valid_csr(*a, kA);
}

TEST(MaskCache, GeneratedMasksAreCertifiedAndMatchDenseSvd) {
  struct Case {
    const char* name;
    MaskKey key;
    const char* method;
    const char* source;
  };
  const std::vector<Case> cases = {
      {"lift 96x64", kA, "lift", "generated:lift seed "},
      {"lift 96x128", kB, "lift", "generated:lift seed "},
      {"random fallback 48x64", kC, "lift", "generated:random seed "},  // r = 64 / 2 does not divide 48 rows
      {"lift 40x24", kD, "lift", "generated:lift seed "},
      {"lift 32x48", kE, "lift", "generated:lift seed "},
      {"random 96x64", kA, "random", "generated:random seed "},
      {"random 40x24", kD, "random", "generated:random seed "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    MaskCache cache(MaskCacheOptions{.method = c.method});
    const auto m = cache.get(c.key);
    expect_valid_csr(*m, c.key);
    EXPECT_EQ(m->source.rfind(c.source, 0), 0u) << m->source;
    EXPECT_TRUE(m->ramanujan);
    const std::int64_t d2 = (m->nnz() + m->cols - 1) / m->cols;
    const double tau = std::sqrt(static_cast<double>(m->row_degree - 1)) + std::sqrt(static_cast<double>(d2 - 1));
    EXPECT_NEAR(m->ramanujan_bound, tau, 1e-12);
    // Independent check: Eigen's Jacobi SVD of the dense 0/1 matrix.
    const std::vector<double> s = kvcal::test::dense_singular_values(to_csr(*m));
    ASSERT_GE(s.size(), 2u);
    EXPECT_NEAR(m->sigma2, s[1], 1e-6 * s[0]);
    EXPECT_LE(s[1], tau) << "not Ramanujan by the dense SVD";
    if (m->nnz() % m->cols == 0) {  // biregular: sigma1 = sqrt(d1 d2)
      EXPECT_NEAR(s[0], std::sqrt(static_cast<double>(m->row_degree * d2)), 1e-9 * s[0]);
    }
    expect_stats(cache.stats(), 0, 1, 1, 0, 0);
  }
}

TEST(MaskCache, GenerationIsDeterministic) {
  MaskCache one, two(MaskCacheOptions{.capacity = 1});
  for (const MaskKey& k : {kA, kB, kC, kD, kE}) {
    EXPECT_TRUE(same_mask(*one.get(k), *two.get(k)));
  }
  // The seed option moves the candidates; the first seed used is the option.
  MaskCache other(MaskCacheOptions{.seed = 12345});
  const auto m = other.get(kB);
  EXPECT_EQ(m->source.rfind("generated:lift seed 1234", 0), 0u) << m->source;
  MaskCache again(MaskCacheOptions{.seed = 12345});
  EXPECT_TRUE(same_mask(*m, *again.get(kB)));
}

TEST(MaskCache, BundleMasksComeFirst) {
  kvcal::runtime::BundleOpenOptions unsealed;  // the format_version 1 golden file has no seal
  unsealed.allow_unverified = true;
  const auto bundle = kvcal::runtime::Bundle::open(kGolden, unsealed);
  ASSERT_EQ(bundle->masks().size(), 1u);
  const auto& stored = bundle->masks().front();  // 96x64, row degree 4
  MaskCache cache;
  cache.attach(bundle.get());
  const auto m = cache.get(96, 64, 1.0 / 16);
  EXPECT_EQ(m, stored);  // the bundle's own mask, not a copy
  EXPECT_EQ(m->source, "bundle:mask_0000");
  expect_stats(cache.stats(), 0, 1, 0, 1, 0);
  EXPECT_EQ(cache.get(96, 64, 1.0 / 16), stored);
  expect_stats(cache.stats(), 1, 1, 0, 1, 0);
  // A shape the bundle lacks is generated.
  const auto g = cache.get(kA);
  EXPECT_EQ(g->source.rfind("generated:", 0), 0u);
  expect_stats(cache.stats(), 1, 2, 1, 1, 0);
  // Detached: the bundle's shape is generated too (in a fresh cache).
  MaskCache plain;
  plain.attach(bundle.get());
  plain.attach(nullptr);
  const auto p = plain.get(96, 64, 1.0 / 16);
  EXPECT_EQ(p->source.rfind("generated:", 0), 0u);
  expect_valid_csr(*p, mask_key(96, 64, 1.0 / 16));
  expect_stats(plain.stats(), 0, 1, 1, 0, 0);
}

TEST(MaskCache, NoCertificateIsAnErrorUnlessAllowed) {
  // Row degree 1: sigma2 = sqrt(d2) > tau = sqrt(d2 - 1) for every candidate.
  const MaskKey never = mask_key(16, 4, 0.25);
  ASSERT_EQ(never.row_degree, 1);
  MaskCache strict(MaskCacheOptions{.tries = 3});
  try {
    strict.get(never);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("16x4"), std::string::npos) << what;
    EXPECT_NE(what.find("3 tries"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  expect_stats(strict.stats(), 0, 1, 0, 0, 0);
  EXPECT_EQ(strict.size(), 0u);
  EXPECT_THROW(strict.get(never), Error);  // a failure is not cached: tried again
  expect_stats(strict.stats(), 0, 2, 0, 0, 0);

  MaskCache lenient(MaskCacheOptions{.tries = 3, .require_ramanujan = false});
  const auto m = lenient.get(never);
  expect_valid_csr(*m, never);
  EXPECT_FALSE(m->ramanujan);
  const std::vector<double> s = kvcal::test::dense_singular_values(to_csr(*m));
  EXPECT_NEAR(m->sigma2, s[1], 1e-6 * s[0]);
  EXPECT_GT(m->sigma2, m->ramanujan_bound);
  expect_stats(lenient.stats(), 0, 1, 1, 0, 0);
}

// Many threads over a few keys with fewer slots than keys: every mask handed
// out is the right one, and the counters add up.
TEST(MaskCache, ConcurrentGetsWithEvictions) {
  const std::vector<MaskKey> keys = {kA, kB, kC, kD, kE};
  std::vector<std::shared_ptr<const Mask>> reference;
  {
    MaskCache ref(MaskCacheOptions{.capacity = keys.size()});
    for (const MaskKey& k : keys) reference.push_back(ref.get(k));
  }
  MaskCache cache(MaskCacheOptions{.capacity = 3});
  constexpr int kThreads = 8, kGets = 150;
  std::atomic<int> wrong{0};
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      std::uint32_t x = 2654435761u * static_cast<std::uint32_t>(t + 1);
      for (int i = 0; i < kGets; ++i) {
        x = x * 1664525u + 1013904223u;
        const std::size_t k = (x >> 16) % keys.size();
        const auto m = cache.get(keys[k]);
        if (!m || !same_mask(*m, *reference[k])) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  const MaskCacheStats s = cache.stats();
  EXPECT_EQ(s.hits + s.misses, kThreads * kGets);
  EXPECT_EQ(s.from_bundle, 0);
  EXPECT_GE(s.generated, static_cast<std::int64_t>(keys.size()));
  EXPECT_LE(s.generated, s.misses);
  // Every built mask went in; what is not there any more was evicted.
  EXPECT_EQ(s.generated - s.evictions, static_cast<std::int64_t>(cache.size()));
  EXPECT_EQ(cache.size(), 3u);
}

// One key hammered from a cold cache: built exactly once, everyone gets it.
TEST(MaskCache, ConcurrentMissesBuildOnce) {
  const MaskKey key = mask_key(256, 256, 1.0 / 16);  // a lift; slower to certify, so the misses overlap
  for (int round = 0; round < 3; ++round) {
    MaskCache cache(MaskCacheOptions{.capacity = 2});
    constexpr int kThreads = 8;
    std::latch start(kThreads);
    std::vector<std::shared_ptr<const Mask>> got(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.arrive_and_wait();
        got[t] = cache.get(key);
        for (int i = 0; i < 20; ++i) {
          if (cache.get(key) != got[t]) got[t] = nullptr;
        }
      });
    }
    for (auto& th : threads) th.join();
    const MaskCacheStats s = cache.stats();
    EXPECT_EQ(s.generated, 1);
    EXPECT_EQ(s.evictions, 0);
    EXPECT_EQ(s.hits + s.misses, kThreads * 21);
    EXPECT_GE(s.misses, 1);
    for (const auto& m : got) EXPECT_EQ(m, got.front());
    ASSERT_NE(got.front(), nullptr);
    expect_valid_csr(*got.front(), key);
    EXPECT_TRUE(got.front()->ramanujan);
  }
}

// A build that fails reaches every thread waiting for it.
TEST(MaskCache, ConcurrentFailuresReachEveryWaiter) {
  const MaskKey never = mask_key(16, 4, 0.25);
  MaskCache cache(MaskCacheOptions{.tries = 4});
  constexpr int kThreads = 8;
  std::latch start(kThreads);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      start.arrive_and_wait();
      try {
        cache.get(never);
      } catch (const Error& e) {
        if (std::string(e.what()).find("16x4") != std::string::npos) ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), kThreads);
  expect_stats(cache.stats(), 0, kThreads, 0, 0, 0);
  EXPECT_EQ(cache.size(), 0u);
}

}  // namespace
