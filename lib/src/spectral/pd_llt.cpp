// One variant of the dense Cholesky factorization (see pd_llt.h). The build
// compiles this file once per instruction-set level with KVCAL_LLT_ISA set
// (avx2, avx512) and the matching -m options. Every Eigen template is then
// instantiated in a namespace of the variant's own (the `Eigen` token is a
// macro here), so that the linker cannot merge an AVX-512 instantiation
// into code that runs on a CPU without AVX-512 (one-definition rule).
#ifndef KVCAL_LLT_ISA
#error "pd_llt.cpp is compiled by lib/CMakeLists.txt with KVCAL_LLT_ISA set"
#endif
#include <cstdint>

#define KVCAL_CAT2(a, b) a##b
#define KVCAL_CAT(a, b) KVCAL_CAT2(a, b)
#define Eigen KVCAL_CAT(kvcal_eigen_, KVCAL_LLT_ISA)
#include <Eigen/Cholesky>
#include <Eigen/Core>

namespace kvcal::detail {

bool KVCAL_CAT(llt_lower_, KVCAL_LLT_ISA)(double* a, std::int64_t n) {
  Eigen::Map<Eigen::MatrixXd> m(a, n, n);
  Eigen::LLT<Eigen::Ref<Eigen::MatrixXd>, Eigen::Lower> llt(m);
  return llt.info() == Eigen::Success;
}

}  // namespace kvcal::detail
