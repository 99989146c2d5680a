#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "kvcal/core/random.h"

namespace kvcal {
namespace {

TEST(Rng, SameSeedSameStream) {
  Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 1000; ++i) {
    const auto x = a.next();
    EXPECT_EQ(x, b.next());
    differs = differs || x != c.next();
  }
  EXPECT_TRUE(differs);
}

TEST(Rng, KnownFirstWords) {
  // Pins the stream: masks from a given seed must never change silently.
  // Reference words from an independent big-integer implementation of
  // splitmix64-seeded xoshiro256**.
  Rng r(0);
  EXPECT_EQ(r.next(), 0x99ec5f36cb75f2b4ULL);
  EXPECT_EQ(r.next(), 0xbf6e1f784956452aULL);
  EXPECT_EQ(r.next(), 0x1a5f849d4933e6e0ULL);
}

TEST(Rng, BelowStaysInRangeAndCoversIt) {
  Rng r(7);
  std::vector<int> hist(10, 0);
  for (int i = 0; i < 100000; ++i) {
    const auto v = r.below(10);
    ASSERT_LT(v, 10u);
    ++hist[v];
  }
  // Each bucket expects 10000; 5 sigma is ~475.
  for (int h : hist) EXPECT_NEAR(h, 10000, 500);
  EXPECT_EQ(r.below(1), 0u);
}

TEST(Rng, ShuffleIsAPermutation) {
  Rng r(3);
  std::vector<int> v(1000);
  std::iota(v.begin(), v.end(), 0);
  r.shuffle(v.data(), v.size());
  std::vector<int> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_FALSE(std::is_sorted(v.begin(), v.end()));
}

TEST(Rng, NormalMoments) {
  Rng r(11);
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal();
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.02);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
}

}  // namespace
}  // namespace kvcal
