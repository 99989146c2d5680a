#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <limits>

#include "kvcal/core/random.h"
#include "kvcal/spectral/pd.h"

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
