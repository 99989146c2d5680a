// Independent dense computations the tests compare kvcal's results against.
#pragma once

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvcal/graph/csr.h"

namespace kvcal::test {

inline Eigen::MatrixXd to_dense(const CsrMask& m) {
  Eigen::MatrixXd b = Eigen::MatrixXd::Zero(m.rows, m.cols);
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (auto k = m.indptr[r]; k < m.indptr[r + 1]; ++k) b(r, m.indices[k]) += 1;
  }
  return b;
}

// All singular values, descending, by Eigen's dense solvers (no Lanczos
// involved): the Jacobi SVD for small masks, the square roots of the smaller
// Gram matrix's eigenvalues (tridiagonal QR) above 256 on the smaller side.
inline std::vector<double> dense_singular_values(const CsrMask& m) {
  const Eigen::MatrixXd b = to_dense(m);
  if (std::min(m.rows, m.cols) <= 256) {
    Eigen::JacobiSVD<Eigen::MatrixXd> svd(b);
    const Eigen::VectorXd s = svd.singularValues();
    return {s.data(), s.data() + s.size()};
  }
  const Eigen::MatrixXd g = m.rows <= m.cols ? Eigen::MatrixXd(b * b.transpose()) : Eigen::MatrixXd(b.transpose() * b);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(g, Eigen::EigenvaluesOnly);
  std::vector<double> s;
  for (Eigen::Index i = g.rows() - 1; i >= 0; --i) s.push_back(std::sqrt(std::max(es.eigenvalues()[i], 0.0)));
  return s;
}

// Builds a CSR from a dense 0/1 pattern.
inline CsrMask from_dense(const Eigen::MatrixXd& b) {
  CsrMask m;
  m.rows = b.rows();
  m.cols = b.cols();
  m.indptr.push_back(0);
  for (Eigen::Index r = 0; r < b.rows(); ++r) {
    for (Eigen::Index c = 0; c < b.cols(); ++c) {
      if (b(r, c) != 0) m.indices.push_back(static_cast<std::int32_t>(c));
    }
    m.indptr.push_back(static_cast<std::int64_t>(m.indices.size()));
  }
  return m;
}

}  // namespace kvcal::test
