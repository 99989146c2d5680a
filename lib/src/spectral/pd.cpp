#include "kvcal/spectral/pd.h"

#include <cmath>
#include <limits>

#include <Eigen/Cholesky>

#include "spectral/pd_llt.h"

namespace kvcal {
namespace detail {

#if KVCAL_LLT_DISPATCH
bool llt_lower_avx2(double* a, std::int64_t n);
bool llt_lower_avx512(double* a, std::int64_t n);
#endif

namespace {
// This translation unit's own Eigen (the build's baseline instruction set).
bool llt_lower_baseline(double* a, std::int64_t n) {
  Eigen::Map<Eigen::MatrixXd> m(a, n, n);
  Eigen::LLT<Eigen::Ref<Eigen::MatrixXd>, Eigen::Lower> llt(m);
  return llt.info() == Eigen::Success;
}
}  // namespace

const std::vector<LltVariant>& llt_variants() {
  static const std::vector<LltVariant> v = [] {
    std::vector<LltVariant> out;
#if KVCAL_LLT_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
      out.push_back({"avx512", llt_lower_avx512});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({"avx2", llt_lower_avx2});
#endif
    out.push_back({"baseline", llt_lower_baseline});
    return out;
  }();
  return v;
}

}  // namespace detail

bool prove_positive_definite(Eigen::MatrixXd& a, double formation_error) {
  const Eigen::Index n = a.rows();
  if (n == 0 || a.cols() != n) return false;
  if (!(formation_error >= 0) || !std::isfinite(formation_error)) return false;
  constexpr double u = std::numeric_limits<double>::epsilon() / 2;  // unit roundoff 2^-53
  const double nu = static_cast<double>(n + 1) * u;
  if (nu >= 0.01) return false;  // the error bounds below assume (n + 1) u << 1
  const double gamma = nu / (1 - nu);

  double trace = 0, max_diag = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    for (Eigen::Index j = i; j < n; ++j) {
      if (!std::isfinite(a(j, i))) return false;
    }
    const double d = a(i, i);
    if (!(d > 0)) return false;  // a positive definite matrix has a positive diagonal
    trace += d;
    max_diag = std::max(max_diag, d);
  }
  trace *= 1 + 2 * nu;  // covers the rounding of the sum itself

  // ||dA||_2 <= gamma / (1 - gamma) * tr(a_s) (Higham Thm 10.5 with
  // tr(R^T R) <= tr(a_s) / (1 - gamma)); the shift's own rounding on the
  // diagonal is at most u * max_diag; the smallest normal number guards the
  // (here practically impossible) underflow terms. The factor 2 is slack.
  const double shift = 2 * (gamma / (1 - gamma) * trace + 2 * u * max_diag + formation_error) +
                       static_cast<double>(n) * std::numeric_limits<double>::min();
  if (!(shift < max_diag)) return false;
  a.diagonal().array() -= shift;

  // The factorization on the best instruction set of the host: the error
  // bound above holds for any evaluation order and for fused multiply-adds.
  if (!detail::llt_variants().front().factor(a.data(), n)) return false;
  for (Eigen::Index i = 0; i < n; ++i) {
    const double r = a(i, i);
    if (!(r > 0) || !std::isfinite(r)) return false;
  }
  return true;
}

}  // namespace kvcal
