// Spectral certification of expander masks (HEX §3.2, Appendix A.1-A.2).
//
// For a (d1, d2)-biregular mask B, sigma1(B) = sqrt(d1 * d2) and B is
// Ramanujan when sigma2(B) <= tau = sqrt(d1 - 1) + sqrt(d2 - 1). For a
// near-biregular mask, d2 is the maximum column degree.
//
// certify() works on the smaller Gram side G (B B^T or B^T B, n x n):
//  * sigma2 is estimated with Spectra's Lanczos on the deflated operator
//    x -> G x - rho v (v^T x), v the top direction (all-ones for biregular).
//  * exact certificate (n <= exact_limit): tau^2 I - (G - rho v v^T) is
//    proven positive definite by a floating-point Cholesky factorization with
//    a rigorous safety shift (see prove_positive_definite). By eigenvalue
//    interlacing, lambda_2(G) <= lambda_1(G - rho v v^T) for any v and any
//    rho >= 0, so this proves sigma2 < tau whatever the accuracy of v.
//  * probabilistic certificate (larger n): k steps of Lanczos from a random
//    start on the deflated operator give a Ritz value theta; by Kuczynski and
//    Wozniakowski (1992), P(lambda_max > theta / (1 - eps)) <= 1.648 sqrt(n)
//    exp(-sqrt(eps) (2k - 1)). kvcal takes eps with theta / (1 - eps) = tau^2
//    and records that probability as failure_probability.
#pragma once

#include <cstdint>
#include <string>

#include "kvcal/graph/csr.h"

namespace kvcal {

enum class CertificateKind { none, exact, probabilistic };
const char* to_string(CertificateKind kind);
CertificateKind parse_certificate_kind(const std::string& name);  // throws kvcal::Error

struct CertifyOptions {
  // Largest Gram side (min(rows, cols)) for the exact certificate.
  std::int64_t exact_limit = 8192;
  // The probabilistic certificate is accepted only below this failure chance.
  double max_failure_probability = 1e-9;
  // Most Lanczos steps for the probabilistic certificate.
  std::int64_t max_lanczos_steps = 400;
  // Seed of the random Lanczos start (probabilistic certificate).
  std::uint64_t seed = 0x6b766361;
  // Threads for Gram formation and mat-vecs (0: all cores).
  int threads = 0;
};

struct Certificate {
  std::int64_t row_degree = 0;  // d1 (maximum row degree)
  std::int64_t col_degree = 0;  // d2 (maximum column degree)
  bool biregular = false;
  double sigma1 = 0;           // largest singular value
  double sigma2 = 0;           // second singular value (Lanczos estimate; 0 if min side is 1)
  double ramanujan_bound = 0;  // tau = sqrt(d1 - 1) + sqrt(d2 - 1)
  bool ramanujan = false;      // sigma2 <= tau proven (exactly or with failure_probability)
  CertificateKind kind = CertificateKind::none;
  double margin = 0;               // tau - sigma2
  double failure_probability = 1;  // 0 for exact, the KW bound for probabilistic, 1 for none
  bool estimate_converged = true;  // Spectra converged on sigma1/sigma2
  std::int64_t lanczos_steps = 0;  // steps used by the probabilistic certificate
};

// tau = sqrt(d1 - 1) + sqrt(d2 - 1) (degrees >= 1).
double ramanujan_bound(std::int64_t d1, std::int64_t d2);

// Certifies a well-formed mask (check_structure(mask).ok(); throws
// kvcal::Error otherwise). Deterministic for a given mask and options.
Certificate certify(const CsrMask& mask, const CertifyOptions& options = {});

}  // namespace kvcal
