#include "kvcal/spectral/certify.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include <omp.h>

#include <Spectra/SymEigsSolver.h>
#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/core/random.h"
#include "kvcal/spectral/pd.h"

namespace kvcal {

const char* to_string(CertificateKind kind) {
  switch (kind) {
    case CertificateKind::none:
      return "none";
    case CertificateKind::exact:
      return "exact";
    case CertificateKind::probabilistic:
      return "probabilistic";
  }
  return "unknown";
}

CertificateKind parse_certificate_kind(const std::string& name) {
  if (name == "none") return CertificateKind::none;
  if (name == "exact") return CertificateKind::exact;
  if (name == "probabilistic") return CertificateKind::probabilistic;
  fail("unknown certificate kind '{}': expected exact, probabilistic or none", name);
}

double ramanujan_bound(std::int64_t d1, std::int64_t d2) {
  return std::sqrt(static_cast<double>(d1 - 1)) + std::sqrt(static_cast<double>(d2 - 1));
}

namespace {

constexpr double kUnitRoundoff = std::numeric_limits<double>::epsilon() / 2;

int thread_count(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

// Matrix-free Gram operator on the smaller side S of the mask:
// y = G x with G = B_S B_S^T (n x n), optionally projected as P G P with
// P = I - v v^T / (v^T v). `s2t` lists each S vertex's neighbours, `t2s` each
// T vertex's. Every output entry is summed by one thread in a fixed order, so
// results do not depend on the thread count.
class GramOp {
 public:
  using Scalar = double;

  GramOp(const CsrMask& s2t, const CsrMask& t2s, int threads)
      : s2t_(s2t), t2s_(t2s), threads_(threads), z_(static_cast<std::size_t>(t2s.rows)) {}

  Eigen::Index rows() const { return s2t_.rows; }
  Eigen::Index cols() const { return s2t_.rows; }

  void project_out(const Eigen::VectorXd* v) {
    v_ = v;
    if (v_) vv_ = v_->squaredNorm();
  }

  void perform_op(const double* x_in, double* y_out) const {
    const Eigen::Index n = rows();
    const double* x = x_in;
    if (v_) {
      px_.resize(n);
      Eigen::Map<const Eigen::VectorXd> xm(x_in, n);
      px_ = xm - (v_->dot(xm) / vv_) * (*v_);
      x = px_.data();
    }
    const bool parallel = threads_ > 1 && s2t_.nnz() > 20000;
    const std::int64_t nt = t2s_.rows;
#pragma omp parallel for schedule(static) num_threads(threads_) if (parallel)
    for (std::int64_t t = 0; t < nt; ++t) {
      double acc = 0;
      for (auto k = t2s_.indptr[t]; k < t2s_.indptr[t + 1]; ++k) acc += x[t2s_.indices[k]];
      z_[t] = acc;
    }
#pragma omp parallel for schedule(static) num_threads(threads_) if (parallel)
    for (std::int64_t s = 0; s < n; ++s) {
      double acc = 0;
      for (auto k = s2t_.indptr[s]; k < s2t_.indptr[s + 1]; ++k) acc += z_[s2t_.indices[k]];
      y_out[s] = acc;
    }
    if (v_) {
      Eigen::Map<Eigen::VectorXd> y(y_out, n);
      y -= (v_->dot(y) / vv_) * (*v_);
    }
  }

 private:
  const CsrMask& s2t_;
  const CsrMask& t2s_;
  int threads_;
  const Eigen::VectorXd* v_ = nullptr;
  double vv_ = 1;
  mutable std::vector<double> z_;
  mutable Eigen::VectorXd px_;
};

Eigen::MatrixXd dense_gram(const CsrMask& s2t, const CsrMask& t2s) {
  const Eigen::Index n = s2t.rows;
  Eigen::MatrixXd g = Eigen::MatrixXd::Zero(n, n);
  for (Eigen::Index s = 0; s < n; ++s) {
    for (auto k = s2t.indptr[s]; k < s2t.indptr[s + 1]; ++k) {
      const auto t = s2t.indices[k];
      for (auto l = t2s.indptr[t]; l < t2s.indptr[t + 1]; ++l) g(t2s.indices[l], s) += 1;
    }
  }
  return g;
}

struct TopEigen {
  double value = 0;
  Eigen::VectorXd vector;
  bool converged = true;
};

Eigen::VectorXd random_start(Eigen::Index n, std::uint64_t seed) {
  Rng rng(seed);
  Eigen::VectorXd x(n);
  for (Eigen::Index i = 0; i < n; ++i) x[i] = rng.normal();
  return x / x.norm();
}

// Largest eigenpair of op (G or P G P): Spectra's implicitly restarted
// Lanczos, with Eigen's dense solver for tiny sizes and as a fallback when
// Spectra fails (its 1.0.1 release mishandles some low-rank operators).
TopEigen top_eigen(GramOp& op, const CsrMask& s2t, const CsrMask& t2s, const Eigen::VectorXd* projector,
                   std::uint64_t seed) {
  const Eigen::Index n = op.rows();
  auto dense = [&]() {
    Eigen::MatrixXd g = dense_gram(s2t, t2s);
    if (projector) {
      const Eigen::VectorXd p = *projector / projector->norm();
      const Eigen::MatrixXd proj = Eigen::MatrixXd::Identity(n, n) - p * p.transpose();
      g = proj * g * proj;
    }
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(g);
    TopEigen r;
    r.value = es.eigenvalues()[n - 1];
    r.vector = es.eigenvectors().col(n - 1);
    r.converged = es.info() == Eigen::Success;
    return r;
  };
  if (n <= 32) return dense();

  // 48 Lanczos vectors: fewer restarts on the clustered top of the bulk.
  const Eigen::Index ncv = std::min<Eigen::Index>(n, 48);
  std::optional<TopEigen> result;
  try {
    Spectra::SymEigsSolver<GramOp> eigs(op, 1, ncv);
    const Eigen::VectorXd start = random_start(n, seed);
    eigs.init(start.data());
    // tol bounds the Ritz residual relative to |theta|; the Ritz value's own
    // error is about residual^2 / gap, far below what the estimate needs.
    eigs.compute(Spectra::SortRule::LargestAlge, 3000, 1e-7);
    log(LogLevel::debug, "Spectra: {} mat-vecs, {} restarts (n = {}, ncv = {})", eigs.num_operations(),
        eigs.num_iterations(), n, ncv);
    if (eigs.info() == Spectra::CompInfo::Successful) {
      result = TopEigen{eigs.eigenvalues()[0], eigs.eigenvectors().col(0), true};
    }
  } catch (const std::exception& e) {
    log(LogLevel::debug, "Spectra failed on the {}x{} Gram operator: {}", n, n, e.what());
  }
  if (result) return *result;
  if (n <= 4096) return dense();
  log(LogLevel::warn, "Lanczos did not converge on the {}x{} Gram operator; sigma estimates are approximate", n, n);
  TopEigen r;
  r.converged = false;
  // Power iteration gives a usable (lower) estimate and direction.
  Eigen::VectorXd x = random_start(n, seed), y(n);
  for (int it = 0; it < 300; ++it) {
    op.perform_op(x.data(), y.data());
    r.value = x.dot(y);
    const double norm = y.norm();
    if (norm == 0) break;
    x = y / norm;
  }
  r.vector = x;
  return r;
}

// Forms a = tau_sq_lo I - G + rho v v^T (lower triangle) and proves it
// positive definite; see certify.h for why that proves sigma2 < tau.
bool exact_certificate(const CsrMask& s2t, const CsrMask& t2s, const Eigen::VectorXd& v, double rho, double tau_sq_lo,
                       int threads) {
  const Eigen::Index n = s2t.rows;
  Eigen::MatrixXd a(n, n);
  const bool parallel = threads > 1 && n >= 256;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<std::int32_t> count(static_cast<std::size_t>(n), 0);
#pragma omp for schedule(dynamic, 16)
    for (Eigen::Index s = 0; s < n; ++s) {
      for (auto k = s2t.indptr[s]; k < s2t.indptr[s + 1]; ++k) {
        const auto t = s2t.indices[k];
        const std::int32_t* begin = t2s.indices.data() + t2s.indptr[t];
        const std::int32_t* end = t2s.indices.data() + t2s.indptr[t + 1];
        // t2s rows are ascending: only the lower triangle (s2 >= s) is needed.
        for (const std::int32_t* p = std::lower_bound(begin, end, static_cast<std::int32_t>(s)); p != end; ++p) {
          ++count[*p];
        }
      }
      const double rv = rho * v[s];
      for (Eigen::Index s2 = s; s2 < n; ++s2) {
        a(s2, s) = rv * v[s2] - count[s2];
        count[s2] = 0;
      }
      a(s, s) += tau_sq_lo;
    }
  }
  // Each entry carries at most two roundings of rho v_i v_j and one or two of
  // the sum: |e_ij| <= 2.01 u (rho |v_i v_j| + |a_ij|), so
  // ||E||_2 <= ||E||_F <= 2.01 u (rho ||v||^2 + ||a||_F); 1.01 covers the norms' rounding.
  const double frob = std::sqrt(2 * a.triangularView<Eigen::StrictlyLower>().toDenseMatrix().squaredNorm() +
                                a.diagonal().squaredNorm());
  const double formation_error = 1.01 * 2.01 * kUnitRoundoff * (rho * v.squaredNorm() + frob);
  return prove_positive_definite(a, formation_error);
}

// w -= Q_k (Q_k^T w) for the first k columns of q, threaded; each output
// entry is summed by one thread in a fixed order (deterministic).
void reorthogonalize(const Eigen::MatrixXd& q, Eigen::Index k, Eigen::VectorXd& w, Eigen::VectorXd& h, int threads) {
  const Eigen::Index n = q.rows();
  const bool parallel = threads > 1 && n * k > 200000;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (Eigen::Index j = 0; j < k; ++j) h[j] = q.col(j).dot(w);
  constexpr Eigen::Index kBlock = 4096;
  const Eigen::Index blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (Eigen::Index blk = 0; blk < blocks; ++blk) {
    const Eigen::Index r0 = blk * kBlock, len = std::min(kBlock, n - r0);
    w.segment(r0, len).noalias() -= q.block(r0, 0, len, k) * h.head(k);
  }
}

struct LanczosResult {
  double theta = 0;  // largest Ritz value
  std::int64_t steps = 0;
  double failure_probability = 1;
  bool proven = false;
  bool converged = false;  // the top Ritz pair's residual is below 1e-7 theta
  std::int64_t reorth_passes = 0;
};

// Plain Lanczos with full reorthogonalization on the PSD operator P G P from
// a start uniform on the sphere, so the Kuczynski-Wozniakowski bound applies.
LanczosResult lanczos_certificate(GramOp& op, double tau_sq, const CertifyOptions& opt) {
  const Eigen::Index n = op.rows();
  const Eigen::Index kmax = std::min<Eigen::Index>(n, std::max<std::int64_t>(opt.max_lanczos_steps, 2));
  Eigen::MatrixXd q(n, kmax);
  std::vector<double> alpha, beta;
  q.col(0) = random_start(n, opt.seed);
  Eigen::VectorXd w(n), h(kmax);
  const int threads = thread_count(opt.threads);
  LanczosResult res;
  for (Eigen::Index k = 0; k < kmax; ++k) {
    op.perform_op(q.col(k).data(), w.data());
    alpha.push_back(q.col(k).dot(w));
    // The three-term recurrence first, so reorthogonalization only removes
    // rounding-level components and one pass is usually enough.
    w -= alpha.back() * q.col(k);
    if (k > 0) w -= beta.back() * q.col(k - 1);
    // Full reorthogonalization (classical Gram-Schmidt), repeated only when a
    // pass removed most of w (the Daniel-Gragg-Kaufman-Stewart criterion).
    double norm_before = w.norm();
    for (int pass = 0; pass < 3; ++pass) {
      reorthogonalize(q, k + 1, w, h, threads);
      ++res.reorth_passes;
      const double norm_after = w.norm();
      if (norm_after > 0.7 * norm_before) break;
      norm_before = norm_after;
    }
    const double b = w.norm();
    const std::int64_t steps = k + 1;
    const bool breakdown = b <= 1e-12 * std::max(1.0, std::abs(alpha.back()));
    const bool last = k + 1 == kmax || breakdown;
    // At a breakdown the Krylov space K_k(A, q0) is invariant, so it equals
    // K_kmax(A, q0) and the bound may use kmax steps.
    const double bound_steps = breakdown ? static_cast<double>(kmax) : static_cast<double>(steps);
    if (steps % 2 == 0 || last) {
      Eigen::VectorXd diag = Eigen::Map<Eigen::VectorXd>(alpha.data(), steps);
      Eigen::VectorXd sub = steps > 1 ? Eigen::Map<Eigen::VectorXd>(beta.data(), steps - 1) : Eigen::VectorXd();
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> tri;
      tri.computeFromTridiagonal(diag, sub, Eigen::ComputeEigenvectors);
      res.theta = tri.eigenvalues()[steps - 1];
      res.steps = steps;
      // ||M y - theta y|| = beta_k |last entry of the Ritz vector| (Paige).
      const double residual = b * std::abs(tri.eigenvectors()(steps - 1, steps - 1));
      res.converged = residual <= 1e-7 * std::max(std::abs(res.theta), 1e-300);
      if (res.theta >= tau_sq) return res;  // not certifiable
      const double eps = 1 - res.theta / tau_sq;
      res.failure_probability = std::min(
          1.0, 1.648 * std::sqrt(static_cast<double>(n)) * std::exp(-std::sqrt(eps) * (2.0 * bound_steps - 1)));
      if (res.failure_probability <= opt.max_failure_probability) {
        res.proven = true;
        return res;
      }
    }
    if (last) break;
    beta.push_back(b);
    q.col(k + 1) = w / b;
  }
  return res;
}

}  // namespace

Certificate certify(const CsrMask& mask, const CertifyOptions& opt) {
  const StructureReport rep = check_structure(mask, false);
  KVCAL_CHECK(rep.ok(), "cannot certify a malformed mask: {}", rep.problems.front());
  KVCAL_CHECK(mask.nnz() >= 1, "cannot certify an empty {}x{} mask", mask.rows, mask.cols);
  Certificate c;
  c.row_degree = rep.row_degree_max;
  c.col_degree = rep.col_degree_max;
  c.biregular = rep.biregular;
  c.ramanujan_bound = ramanujan_bound(c.row_degree, c.col_degree);
  const double tau = c.ramanujan_bound;
  const int threads = thread_count(opt.threads);

  // The smaller side S carries the Gram matrix.
  const bool rows_side = mask.rows <= mask.cols;
  const CsrMask other = transpose(mask);
  const CsrMask& s2t = rows_side ? mask : other;
  const CsrMask& t2s = rows_side ? other : mask;
  const Eigen::Index n = s2t.rows;

  if (n == 1) {  // one singular value only: sigma2 = 0 and the bound holds
    c.sigma1 = std::sqrt(static_cast<double>(mask.nnz()));
    c.sigma2 = 0;
    c.ramanujan = true;
    c.kind = CertificateKind::exact;
    c.failure_probability = 0;
    c.margin = tau;
    return c;
  }

  GramOp op(s2t, t2s, threads);
  Eigen::VectorXd v;
  double rho;
  if (rep.biregular) {
    // B 1 = d1 1 and B^T 1 = d2 1, and ||B||_2 <= sqrt(||B||_1 ||B||_inf):
    // sigma1 = sqrt(d1 d2) exactly, with the all-ones top direction.
    v = Eigen::VectorXd::Constant(n, 1.0 / std::sqrt(static_cast<double>(n)));
    rho = static_cast<double>(c.row_degree) * static_cast<double>(c.col_degree);
    c.sigma1 = std::sqrt(rho);
  } else {
    TopEigen top = top_eigen(op, s2t, t2s, nullptr, opt.seed);
    rho = std::max(top.value, 0.0);
    v = top.vector;
    if (!v.allFinite() || v.norm() == 0) v = Eigen::VectorXd::Constant(n, 1.0 / std::sqrt(static_cast<double>(n)));
    c.sigma1 = std::sqrt(rho);
    c.estimate_converged = top.converged;
  }

  // tau^2 rounded down: sqrt and the sum carry at most ~3 roundings.
  const double tau_sq = static_cast<double>(c.row_degree + c.col_degree - 2) +
                        2 * std::sqrt(static_cast<double>(c.row_degree - 1) * static_cast<double>(c.col_degree - 1));
  const double tau_sq_lo = tau_sq * (1 - 8 * kUnitRoundoff);

  // sigma2 estimate: Spectra on P G P; in the probabilistic path the
  // certificate's own Lanczos run gives it when its top Ritz pair converged.
  op.project_out(&v);
  auto estimate_sigma2 = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    const TopEigen second = top_eigen(op, s2t, t2s, &v, opt.seed + 1);
    c.sigma2 = std::sqrt(std::max(second.value, 0.0));
    c.estimate_converged = c.estimate_converged && second.converged;
    log(LogLevel::debug, "{}x{} mask: sigma2 estimate {:.9g} in {:.3f} s", mask.rows, mask.cols, c.sigma2,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  const auto t_certify = std::chrono::steady_clock::now();
  if (n <= opt.exact_limit) {
    estimate_sigma2();
    c.ramanujan = exact_certificate(s2t, t2s, v, rho, tau_sq_lo, threads);
    c.kind = c.ramanujan ? CertificateKind::exact : CertificateKind::none;
    c.failure_probability = c.ramanujan ? 0.0 : 1.0;
  } else {
    const LanczosResult lr = lanczos_certificate(op, tau_sq_lo, opt);
    c.lanczos_steps = lr.steps;
    log(LogLevel::debug, "Lanczos: {} steps, {} reorthogonalization passes, theta = {:.9g}, failure bound {:.3g}",
        lr.steps, lr.reorth_passes, lr.theta, lr.failure_probability);
    c.ramanujan = lr.proven;
    c.kind = lr.proven ? CertificateKind::probabilistic : CertificateKind::none;
    c.failure_probability = lr.proven ? lr.failure_probability : 1.0;
    if (lr.converged) {
      c.sigma2 = std::sqrt(std::max(lr.theta, 0.0));
    } else {
      estimate_sigma2();
    }
  }
  c.margin = tau - c.sigma2;
  log(LogLevel::debug, "{}x{} mask: {} certificate and estimate in {:.3f} s", mask.rows, mask.cols, to_string(c.kind),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_certify).count());
  return c;
}

}  // namespace kvcal
