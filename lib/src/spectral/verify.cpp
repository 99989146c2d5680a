#include "kvcal/spectral/verify.h"

#include <cmath>

#include <fmt/format.h>

namespace kvcal {
namespace {
bool close(double a, double b, double tol) { return std::isfinite(a) && std::abs(a - b) <= tol; }
}  // namespace

Verification verify_claims(const CsrMask& mask, const Certificate& stored, const CertifyOptions& options) {
  Verification v;
  auto& bad = v.false_claims;
  v.structure = check_structure(mask, true);
  const StructureReport& s = v.structure;
  for (const auto& p : s.problems) bad.push_back("CSR: " + p);
  if (!s.ok()) return v;

  if (s.row_degree_min != s.row_degree_max) {
    bad.push_back(
        fmt::format("row degrees vary ({}..{}); a mask has one row degree", s.row_degree_min, s.row_degree_max));
  }
  if (stored.row_degree != s.row_degree_max) {
    bad.push_back(fmt::format("row_degree is {} but rows hold {} ones", stored.row_degree, s.row_degree_max));
  }
  if (stored.col_degree != s.col_degree_max) {
    bad.push_back(
        fmt::format("col_degree is {} but the largest column holds {} ones", stored.col_degree, s.col_degree_max));
  }
  if (stored.biregular != s.biregular) {
    bad.push_back(fmt::format("biregular is {} but column degrees are {}..{}", int{stored.biregular}, s.col_degree_min,
                              s.col_degree_max));
  }
  if (stored.ramanujan && s.components > 1) {
    bad.push_back(
        fmt::format("claims Ramanujan but the graph has {} connected components (sigma2 = sigma1)", s.components));
  }
  if (mask.nnz() == 0) {
    bad.push_back("the mask is empty");
    return v;
  }

  v.recomputed = certify(mask, options);
  v.recertified = true;
  const Certificate& c = v.recomputed;
  if (!close(stored.ramanujan_bound, c.ramanujan_bound, 1e-9 * c.ramanujan_bound + 1e-12)) {
    bad.push_back(
        fmt::format("ramanujan_bound is {:.9g}, recomputed {:.9g}", stored.ramanujan_bound, c.ramanujan_bound));
  }
  // sigma1 is exact for biregular masks and converged Lanczos otherwise.
  if (!close(stored.sigma1, c.sigma1, 1e-6 * std::max(1.0, c.sigma1))) {
    bad.push_back(fmt::format("sigma1 is {:.9g}, recomputed {:.9g}", stored.sigma1, c.sigma1));
  }
  // sigma2 is a Lanczos estimate converged to ~1e-10 relative on sigma2^2; the
  // tolerance leaves room for estimates stored by another build.
  if (!close(stored.sigma2, c.sigma2, 1e-5 * std::max(1.0, c.sigma1))) {
    bad.push_back(fmt::format("sigma2 is {:.9g}, recomputed {:.9g}", stored.sigma2, c.sigma2));
  }
  if (!close(stored.margin, stored.ramanujan_bound - stored.sigma2, 1e-9 * std::max(1.0, c.ramanujan_bound))) {
    bad.push_back(fmt::format("certificate_margin {:.9g} is not ramanujan_bound - sigma2 = {:.9g}", stored.margin,
                              stored.ramanujan_bound - stored.sigma2));
  }
  if (stored.ramanujan && !c.ramanujan) {
    bad.push_back(
        fmt::format("claims Ramanujan (sigma2 <= {:.6g}) but that cannot be proven: recomputed sigma2 = {:.6g}",
                    c.ramanujan_bound, c.sigma2));
  }
  if (!stored.ramanujan && c.ramanujan) {
    bad.push_back("claims not Ramanujan but the recomputation proves it is");
  }
  if (stored.ramanujan && c.ramanujan) {
    if (stored.kind == CertificateKind::exact && c.kind != CertificateKind::exact) {
      bad.push_back(fmt::format("claims an exact certificate but only a {} one can be made", to_string(c.kind)));
    }
    if (stored.kind == CertificateKind::none) bad.push_back("claims Ramanujan without a certificate");
  }
  if (!stored.ramanujan && stored.kind != CertificateKind::none) {
    bad.push_back(fmt::format("has a '{}' certificate but does not claim Ramanujan", to_string(stored.kind)));
  }
  const double fp = stored.failure_probability;
  const bool fp_ok = stored.kind == CertificateKind::exact  ? fp == 0
                     : stored.kind == CertificateKind::none ? fp == 1
                                                            : (fp > 0 && fp < 1);
  if (!fp_ok) {
    bad.push_back(fmt::format("failure_probability {} does not fit a '{}' certificate", fp, to_string(stored.kind)));
  }
  return v;
}

}  // namespace kvcal
