#include <gtest/gtest.h>

#include <cmath>

#include "dense_reference.h"
#include "kvcal/core/error.h"
#include "kvcal/graph/generate.h"
#include "kvcal/spectral/certify.h"
#include "kvcal/spectral/verify.h"

namespace kvcal {
namespace {

struct Case {
  std::int64_t rows, cols, d1;
  MaskMethod method;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.rows << "x" << c.cols << " d1=" << c.d1 << " " << to_string(c.method);
}

// Tolerance on sigma estimates against Eigen's dense SVD: both are accurate to
// ~1e-12 relative here; 1e-7 leaves room for Lanczos on clustered spectra.
constexpr double kSigmaTol = 1e-7;

// `kw_steps` > 0: the certificate is the probabilistic one with that many
// Lanczos steps at most; it must then prove every case the
// Kuczynski-Wozniakowski bound allows at the true sigma2.
void check_against_dense(const CsrMask& m, const Certificate& c, std::int64_t kw_steps = 0, double max_failure = 1e-9) {
  const std::vector<double> s = test::dense_singular_values(m);
  const double s1 = s[0];
  const double s2 = s.size() > 1 ? s[1] : 0.0;
  EXPECT_NEAR(c.sigma1, s1, kSigmaTol * std::max(1.0, s1));
  EXPECT_NEAR(c.sigma2, s2, kSigmaTol * std::max(1.0, s1));
  EXPECT_DOUBLE_EQ(c.ramanujan_bound, std::sqrt(c.row_degree - 1.0) + std::sqrt(c.col_degree - 1.0));
  // The certificate never claims what the dense spectrum denies, and proves
  // every case that is not within rounding of the bound.
  if (c.ramanujan) {
    EXPECT_LE(s2, c.ramanujan_bound + 1e-9);
  }
  const double tau = c.ramanujan_bound;
  if (kw_steps == 0 || std::min(m.rows, m.cols) == 1) {
    if (s2 < tau - 1e-6) {
      EXPECT_TRUE(c.ramanujan) << "dense sigma2 " << s2 << " tau " << tau;
    }
  } else if (s2 < tau) {
    const double eps = 1 - (s2 * s2) / (tau * tau);
    const double n = static_cast<double>(std::min(m.rows, m.cols));
    const double k = static_cast<double>(std::min<std::int64_t>(kw_steps, std::min(m.rows, m.cols)));
    // 1.2: slack for the bound being checked every 8 steps.
    if (1.648 * std::sqrt(n) * std::exp(-std::sqrt(eps) * (2 * k / 1.2 - 1)) < max_failure) {
      EXPECT_TRUE(c.ramanujan) << "dense sigma2 " << s2 << " tau " << tau;
    }
  }
  if (s2 > c.ramanujan_bound + 1e-9) {
    EXPECT_FALSE(c.ramanujan);
  }
  EXPECT_NEAR(c.margin, c.ramanujan_bound - c.sigma2, 1e-12 * std::max(1.0, c.ramanujan_bound));
}

class CertifyShapes : public ::testing::TestWithParam<Case> {};

TEST_P(CertifyShapes, MatchesDenseSvd) {
  const auto& p = GetParam();
  const MaskShape s = resolve_shape(p.rows, p.cols, p.d1, std::nullopt);
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const CsrMask m = generate(p.method, s, seed);
    const Certificate exact = certify(m);
    check_against_dense(m, exact);
    EXPECT_EQ(exact.kind, exact.ramanujan ? CertificateKind::exact : CertificateKind::none);
    EXPECT_EQ(exact.failure_probability, exact.ramanujan ? 0.0 : 1.0);

    CertifyOptions prob;
    prob.exact_limit = 0;  // force the Lanczos + Kuczynski-Wozniakowski path
    const Certificate pc = certify(m, prob);
    check_against_dense(m, pc, prob.max_lanczos_steps, prob.max_failure_probability);
    if (pc.ramanujan && std::min(m.rows, m.cols) > 1) {
      EXPECT_EQ(pc.kind, CertificateKind::probabilistic);
      EXPECT_GT(pc.failure_probability, 0.0);
      EXPECT_LE(pc.failure_probability, prob.max_failure_probability);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CertifyShapes,
                         ::testing::ValuesIn(std::vector<Case>{
                             {96, 128, 4, MaskMethod::random},
                             {96, 128, 4, MaskMethod::lift},
                             {96, 128, 6, MaskMethod::random},
                             {96, 128, 1, MaskMethod::random},
                             {96, 128, 128, MaskMethod::random},
                             {96, 128, 100, MaskMethod::random},
                             {1, 17, 5, MaskMethod::random},
                             {17, 1, 1, MaskMethod::random},
                             {2, 2, 1, MaskMethod::random},
                             {101, 103, 7, MaskMethod::random},
                             {128, 96, 3, MaskMethod::random},
                             {256, 64, 16, MaskMethod::lift},
                             {300, 40, 5, MaskMethod::random},
                             {60, 300, 20, MaskMethod::random},
                             {3, 7, 7, MaskMethod::lift},
                         }));

TEST(Certify, CompleteGraphHasNoSecondSingularValue) {
  const CsrMask m = generate_random(resolve_shape(12, 20, 20, std::nullopt), 1);
  const Certificate c = certify(m);
  EXPECT_NEAR(c.sigma1, std::sqrt(20.0 * 12.0), 1e-12);
  EXPECT_NEAR(c.sigma2, 0.0, 1e-6);
  EXPECT_TRUE(c.ramanujan);
  EXPECT_EQ(c.kind, CertificateKind::exact);
}

TEST(Certify, DisjointBlocksAreRejected) {
  // Two disjoint complete 8x8 blocks: 8-regular, sigma2 = sigma1 = 8.
  Eigen::MatrixXd b = Eigen::MatrixXd::Zero(16, 16);
  b.topLeftCorner(8, 8).setOnes();
  b.bottomRightCorner(8, 8).setOnes();
  const Certificate c = certify(test::from_dense(b));
  EXPECT_NEAR(c.sigma1, 8.0, 1e-12);
  EXPECT_NEAR(c.sigma2, 8.0, 1e-6);
  EXPECT_FALSE(c.ramanujan);
  EXPECT_EQ(c.kind, CertificateKind::none);
  CertifyOptions prob;
  prob.exact_limit = 0;
  EXPECT_FALSE(certify(test::from_dense(b), prob).ramanujan);
}

TEST(Certify, PerfectMatchingIsNotRamanujan) {
  // d1 = d2 = 1: every singular value is 1 > tau = 0.
  const Certificate c = certify(test::from_dense(Eigen::MatrixXd::Identity(10, 10)));
  EXPECT_NEAR(c.sigma2, 1.0, 1e-9);
  EXPECT_FALSE(c.ramanujan);
}

TEST(Certify, LargeShapeAgreesWithDenseEigensolver) {
  // Above Spectra's dense cutoff, on both Gram sides.
  for (auto [rows, cols, d1] : std::vector<std::array<std::int64_t, 3>>{{1024, 256, 8}, {200, 1200, 60}}) {
    const CsrMask m = generate_random(resolve_shape(rows, cols, d1, std::nullopt), 4);
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    check_against_dense(m, certify(m));
  }
}

TEST(Certify, ThreadCountDoesNotChangeResults) {
  const CsrMask m = generate_random(resolve_shape(2048, 512, 16, std::nullopt), 9);
  CertifyOptions one, two;
  one.threads = 1;
  two.threads = 2;
  const Certificate a = certify(m, one), b = certify(m, two);
  EXPECT_EQ(a.sigma2, b.sigma2);
  EXPECT_EQ(a.ramanujan, b.ramanujan);
  EXPECT_EQ(a.kind, b.kind);
}

TEST(Certify, RejectsMalformedMask) {
  CsrMask m{2, 3, {0, 2, 4}, {0, 0, 1, 2}};
  EXPECT_THROW(certify(m), Error);
}

TEST(VerifyClaims, AcceptsTrueClaimsAndNamesFalseOnes) {
  const CsrMask m = generate_random(resolve_shape(96, 128, 4, std::nullopt), 1);
  const Certificate c = certify(m);
  ASSERT_TRUE(c.ramanujan);
  EXPECT_TRUE(verify_claims(m, c).ok());

  Certificate wrong = c;
  wrong.sigma2 += 0.01;
  wrong.margin -= 0.01;
  EXPECT_FALSE(verify_claims(m, wrong).ok());
  wrong = c;
  wrong.row_degree = 5;
  EXPECT_FALSE(verify_claims(m, wrong).ok());
  wrong = c;
  wrong.biregular = false;
  EXPECT_FALSE(verify_claims(m, wrong).ok());
  wrong = c;
  wrong.failure_probability = 0.5;
  EXPECT_FALSE(verify_claims(m, wrong).ok());

  CsrMask bad = m;
  bad.indices[1] = bad.indices[0];  // plant a repeated column
  EXPECT_FALSE(verify_claims(bad, c).ok());
}

TEST(VerifyClaims, RejectsRamanujanClaimOnDisconnectedGraph) {
  Eigen::MatrixXd b = Eigen::MatrixXd::Zero(16, 16);
  b.topLeftCorner(8, 8).setOnes();
  b.bottomRightCorner(8, 8).setOnes();
  const CsrMask m = test::from_dense(b);
  Certificate lie = certify(m);
  lie.ramanujan = true;
  lie.kind = CertificateKind::exact;
  lie.failure_probability = 0;
  const auto v = verify_claims(m, lie);
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.structure.components, 2);
}

}  // namespace
}  // namespace kvcal
