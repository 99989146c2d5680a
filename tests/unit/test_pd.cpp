#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kvcal/core/random.h"
#include "kvcal/spectral/pd.h"
#include "spectral/pd_llt.h"

namespace kvcal {
namespace {

// Q diag(lambda) Q^T with a random orthogonal Q.
Eigen::MatrixXd with_spectrum(const Eigen::VectorXd& lambda, std::uint64_t seed) {
  const Eigen::Index n = lambda.size();
  Rng rng(seed);
  Eigen::MatrixXd g(n, n);
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) g(i, j) = rng.normal();
  Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
  const Eigen::MatrixXd q = qr.householderQ();
  Eigen::MatrixXd a = q * lambda.asDiagonal() * q.transpose();
  return (a + a.transpose()) / 2;
}

// Every Cholesky variant this CPU runs (AVX-512, AVX2, baseline) against an
// unblocked Cholesky in long double, on a matrix larger than Eigen's blocking.
TEST(ProvePositiveDefinite, EveryCholeskyVariantMatchesAPlainFactorization) {
  const auto& variants = detail::llt_variants();
  ASSERT_FALSE(variants.empty());
  EXPECT_STREQ(variants.back().name, "baseline");
  std::string names;
  for (const auto& v : variants) names += std::string(v.name) + " ";
  std::printf("Cholesky variants on this CPU: %s\n", names.c_str());
  const Eigen::Index n = 300;
  const Eigen::MatrixXd a = with_spectrum(Eigen::VectorXd::LinSpaced(n, 1.0, 10.0), 7);
  std::vector<long double> l(static_cast<std::size_t>(n * n), 0.0L);  // column-major
  const auto L = [&](Eigen::Index i, Eigen::Index j) -> long double& { return l[static_cast<std::size_t>(j * n + i)]; };
  for (Eigen::Index j = 0; j < n; ++j) {
    long double d = a(j, j);
    for (Eigen::Index k = 0; k < j; ++k) d -= L(j, k) * L(j, k);
    ASSERT_GT(d, 0.0L);
    L(j, j) = std::sqrt(d);
    for (Eigen::Index i = j + 1; i < n; ++i) {
      long double s = a(i, j);
      for (Eigen::Index k = 0; k < j; ++k) s -= L(i, k) * L(j, k);
      L(i, j) = s / L(j, j);
    }
  }
  for (const auto& v : variants) {
    SCOPED_TRACE(v.name);
    Eigen::MatrixXd f = a;
    ASSERT_TRUE(v.factor(f.data(), n));
    double worst = 0;
    for (Eigen::Index j = 0; j < n; ++j)
      for (Eigen::Index i = j; i < n; ++i) worst = std::max(worst, static_cast<double>(std::fabs(f(i, j) - L(i, j))));
    // cond(A) = 10, entries of L below sqrt(10): a backward-stable factor is
    // within a few hundred ulps.
    EXPECT_LT(worst, 1e-12);
    // An indefinite matrix fails on every variant.
    Eigen::MatrixXd bad = with_spectrum(Eigen::VectorXd::LinSpaced(n, -1.0, 10.0), 8);
    EXPECT_FALSE(v.factor(bad.data(), n));
  }
}

TEST(ProvePositiveDefinite, ClearlyPositive) {
  Eigen::VectorXd lambda = Eigen::VectorXd::LinSpaced(200, 0.5, 50.0);
  Eigen::MatrixXd a = with_spectrum(lambda, 1);
  EXPECT_TRUE(prove_positive_definite(a, 0.0));
}

TEST(ProvePositiveDefinite, RejectsSingularAndIndefinite) {
  Eigen::VectorXd lambda = Eigen::VectorXd::LinSpaced(200, 0.0, 50.0);  // lambda_min = 0
  Eigen::MatrixXd a = with_spectrum(lambda, 2);
  EXPECT_FALSE(prove_positive_definite(a, 0.0));
  lambda[0] = -1e-3;
  a = with_spectrum(lambda, 3);
  EXPECT_FALSE(prove_positive_definite(a, 0.0));
  // The all-ones matrix is PSD with rank one: not positive definite.
  Eigen::MatrixXd j = Eigen::MatrixXd::Ones(64, 64);
  EXPECT_FALSE(prove_positive_definite(j, 0.0));
}

TEST(ProvePositiveDefinite, SmallMarginStillProven) {
  // lambda_min = 1e-6 with ||A|| = 10: far above the rigorous shift (~1e-11).
  Eigen::VectorXd lambda = Eigen::VectorXd::LinSpaced(100, 1e-6, 10.0);
  Eigen::MatrixXd a = with_spectrum(lambda, 4);
  EXPECT_TRUE(prove_positive_definite(a, 0.0));
}

TEST(ProvePositiveDefinite, FormationErrorIsHonoured) {
  // A matrix proven PD on its own is no longer proven once its entries may be
  // off by more than its smallest eigenvalue.
  Eigen::VectorXd lambda = Eigen::VectorXd::LinSpaced(50, 1e-3, 5.0);
  Eigen::MatrixXd a = with_spectrum(lambda, 5);
  Eigen::MatrixXd b = a;
  EXPECT_TRUE(prove_positive_definite(a, 1e-5));
  EXPECT_FALSE(prove_positive_definite(b, 1e-3));
}

TEST(ProvePositiveDefinite, RejectsNonFiniteAndBadInput) {
  Eigen::MatrixXd a = Eigen::MatrixXd::Identity(4, 4);
  a(2, 1) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(prove_positive_definite(a, 0.0));
  Eigen::MatrixXd b = Eigen::MatrixXd::Identity(4, 4);
  EXPECT_FALSE(prove_positive_definite(b, -1.0));
  Eigen::MatrixXd empty;
  EXPECT_FALSE(prove_positive_definite(empty, 0.0));
  Eigen::MatrixXd id = Eigen::MatrixXd::Identity(3, 3);
  EXPECT_TRUE(prove_positive_definite(id, 0.0));
}

}  // namespace
}  // namespace kvcal
