// Verified positive definiteness of a symmetric matrix in floating point.
#pragma once

#include <Eigen/Core>

namespace kvcal {

// Proves that the exact symmetric matrix A_true is positive definite, given
// its floating-point image `a` (only the lower triangle is read) and a bound
// `formation_error` >= ||A_true - a||_2 on how far `a` is from it.
//
// Method (after Rump, "Verification of positive definiteness", BIT 2006, and
// Higham, "Accuracy and Stability of Numerical Algorithms", Thm 10.5): if
// Cholesky runs to completion on a_s = fl(a - c I), its computed factor R
// satisfies R^T R = a_s + dA with ||dA||_2 <= g/(1-g) tr(a_s), g = gamma_{n+1}.
// So lambda_min(A_true) >= c - g/(1-g) tr(a_s) - u max|a_s,ii| -
// formation_error, and the shift c is chosen as twice that sum (plus an
// underflow guard). Returns true when proven; false means "not proven", not
// "indefinite". `a` is overwritten by the factorization.
bool prove_positive_definite(Eigen::MatrixXd& a, double formation_error);

}  // namespace kvcal
