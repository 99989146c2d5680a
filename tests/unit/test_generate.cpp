#include <gtest/gtest.h>

#include <set>

#include "kvcal/core/error.h"
#include "kvcal/graph/generate.h"

namespace kvcal {
namespace {

struct ShapeCase {
  std::int64_t rows, cols, d1;
};

void PrintTo(const ShapeCase& c, std::ostream* os) { *os << c.rows << "x" << c.cols << " d1=" << c.d1; }

class RandomShapes : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(RandomShapes, SimpleAndDegreesExact) {
  const auto& p = GetParam();
  const MaskShape s = resolve_shape(p.rows, p.cols, p.d1, std::nullopt);
  for (std::uint64_t seed : {1u, 2u, 977u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const CsrMask m = generate_random(s, seed);
    const auto r = check_structure(m, false);
    ASSERT_TRUE(r.ok()) << r.problems.front();
    EXPECT_EQ(r.row_degree_min, p.d1);
    EXPECT_EQ(r.row_degree_max, p.d1);
    EXPECT_EQ(r.col_degree_max, s.col_degree_max);
    EXPECT_EQ(r.col_degree_min, s.col_degree_min);
    EXPECT_EQ(r.biregular, s.biregular());
    EXPECT_TRUE(r.near_biregular);
    EXPECT_EQ(generate_random(s, seed), m) << "not deterministic";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, RandomShapes,
                         ::testing::ValuesIn(std::vector<ShapeCase>{
                             {96, 128, 4},    // the HEX block, rho = 1/32
                             {96, 128, 6},    // near-biregular (4.5 per column)
                             {96, 128, 1},    // d1 = 1
                             {96, 128, 128},  // d1 = D: the complete graph
                             {96, 128, 127},  // dense: built from the complement
                             {96, 128, 64},   // exactly half
                             {1, 17, 5},      // a single row
                             {1, 1, 1},       // a single entry
                             {101, 103, 7},   // primes
                             {13, 97, 96},    // prime sizes, dense
                             {512, 64, 8},    // tall
                             {7, 4096, 128},  // wide, few rows
                             {4096, 128, 4},
                         }));

TEST(GenerateRandom, SeedsGiveDifferentMasks) {
  const MaskShape s = resolve_shape(96, 128, 4, std::nullopt);
  EXPECT_NE(generate_random(s, 1), generate_random(s, 2));
}

TEST(GenerateLift, BlockStructure) {
  const MaskShape s = resolve_shape(96, 128, 4, std::nullopt);  // r = 32, d2 = 3
  ASSERT_TRUE(lift_shape_problem(s).empty());
  const CsrMask m = generate_lift(s, 5);
  const auto r = check_structure(m, false);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.biregular);
  EXPECT_EQ(r.col_degree_max, 3);
  for (std::int64_t row = 0; row < m.rows; ++row) {
    for (std::int64_t b = 0; b < 4; ++b) {
      const auto c = m.indices[m.indptr[row] + b];
      EXPECT_EQ(c / 32, b) << "row " << row << " must keep one channel per group of 32";
    }
  }
  // Each (row fibre, column fibre) pair is a permutation: columns of one
  // fibre pair are all distinct.
  for (std::int64_t a = 0; a < 3; ++a) {
    for (std::int64_t b = 0; b < 4; ++b) {
      std::set<std::int32_t> seen;
      for (std::int64_t t = 0; t < 32; ++t) seen.insert(m.indices[m.indptr[a * 32 + t] + b]);
      EXPECT_EQ(seen.size(), 32u);
    }
  }
  EXPECT_EQ(generate_lift(s, 5), m);
  EXPECT_NE(generate_lift(s, 6), m);
}

TEST(GenerateLift, AwkwardButValidShapes) {
  for (auto [rows, cols, d1] :
       std::vector<std::array<std::int64_t, 3>>{{1, 1, 1}, {5, 5, 1}, {3, 7, 7}, {64, 64, 64}}) {
    const MaskShape s = resolve_shape(rows, cols, d1, std::nullopt);
    ASSERT_TRUE(lift_shape_problem(s).empty()) << rows << "x" << cols;
    const auto r = check_structure(generate_lift(s, 1), false);
    EXPECT_TRUE(r.ok() && r.biregular) << rows << "x" << cols;
  }
}

TEST(GenerateLift, RejectsShapesItCannotHold) {
  EXPECT_FALSE(lift_shape_problem(resolve_shape(96, 128, 6, std::nullopt)).empty());   // 128 % 6
  EXPECT_FALSE(lift_shape_problem(resolve_shape(100, 128, 4, std::nullopt)).empty());  // 100 % 32
  EXPECT_THROW(generate_lift(resolve_shape(100, 128, 4, std::nullopt), 1), Error);
}

TEST(ResolveShape, SparsityAndDegree) {
  const auto a = resolve_shape(96, 128, std::nullopt, 1.0 / 32);
  EXPECT_EQ(a.row_degree, 4);
  EXPECT_EQ(a.col_degree_max, 3);
  EXPECT_TRUE(a.biregular());
  const auto b = resolve_shape(96, 128, std::nullopt, 0.046875);
  EXPECT_EQ(b.row_degree, 6);
  EXPECT_EQ(b.col_degree_min, 4);
  EXPECT_EQ(b.col_degree_max, 5);
  EXPECT_EQ(resolve_shape(10, 1000, std::nullopt, 1e-6).row_degree, 1);  // at least one
}

TEST(ResolveShape, RejectsImpossibleParameters) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(resolve_shape(96, 128, std::nullopt, 0.0), Error);
  EXPECT_THROW(resolve_shape(96, 128, std::nullopt, -0.5), Error);
  EXPECT_THROW(resolve_shape(96, 128, std::nullopt, 1.5), Error);
  EXPECT_THROW(resolve_shape(96, 128, std::nullopt, nan), Error);
  EXPECT_THROW(resolve_shape(0, 128, 4, std::nullopt), Error);
  EXPECT_THROW(resolve_shape(96, -1, 4, std::nullopt), Error);
  EXPECT_THROW(resolve_shape(96, 128, 0, std::nullopt), Error);
  EXPECT_THROW(resolve_shape(96, 128, 129, std::nullopt), Error);
  EXPECT_THROW(resolve_shape(96, 128, 4, 0.5), Error);                      // both
  EXPECT_THROW(resolve_shape(96, 128, std::nullopt, std::nullopt), Error);  // neither
  EXPECT_THROW(resolve_shape(std::int64_t{1} << 32, 128, 4, std::nullopt), Error);
  EXPECT_THROW(parse_mask_method("lps"), Error);
}

}  // namespace
}  // namespace kvcal
