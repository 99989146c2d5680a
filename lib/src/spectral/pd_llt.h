// The Cholesky factorization behind prove_positive_definite, in variants for
// the instruction sets of the host (pd_llt.cpp is compiled once per x86-64
// level; the portable build would otherwise run Eigen's SSE2 code on an
// AVX-512 machine, twice as slow).
#pragma once

#include <cstdint>
#include <vector>

namespace kvcal::detail {

// Factors the column-major n x n matrix at a (lower triangle read and
// overwritten by L, A = L L^T); false when Eigen's LLT reports failure.
using LltLower = bool (*)(double* a, std::int64_t n);

struct LltVariant {
  const char* name;  // "avx512", "avx2" or "baseline"
  LltLower factor;
};

// The variants this CPU can run, best first ("baseline" always last).
const std::vector<LltVariant>& llt_variants();

}  // namespace kvcal::detail
